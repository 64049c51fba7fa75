"""The alpha-beta time model of one collective (Parm §V-A, Eq. 12) and its least-squares fit.

    time(x) = alpha + beta * x      x: elements (values) the collective moves, in the convention of
                                    `distributed/collectives.py` (all-gather: gathered output;
                                    all-to-all: this rank's input)

alpha is the start-up time (s), beta the time per element (s). `fit_alpha_beta` estimates both from
timings at several message sizes, as Parm §VI-B does, and reports the fit quality R^2.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np


@dataclass(frozen=True)
class AlphaBeta:
    alpha: float  # s
    beta: float  # s per element
    r2: Optional[float] = None  # coefficient of determination of the fit (None: not fitted)

    def time(self, elements: float) -> float:
        return self.alpha + self.beta * elements


def fit_alpha_beta(elements: Sequence[float], seconds: Sequence[float]) -> AlphaBeta:
    """Least-squares line through (elements, seconds), with alpha, beta >= 0 (a profile's times
    never fall below zero or with size); at least two distinct sizes."""
    x, t = np.asarray(elements, dtype=np.float64), np.asarray(seconds, dtype=np.float64)
    if x.shape != t.shape or len(set(x.tolist())) < 2:
        raise ValueError("fit_alpha_beta needs timings at two or more distinct message sizes")
    design = np.stack([np.ones_like(x), x], axis=1)  # [samples, 2]
    (alpha, beta), *_ = np.linalg.lstsq(design, t, rcond=None)
    if alpha < 0:  # noise: a negative start-up time; best line through the origin instead
        alpha, beta = 0.0, float((x * t).sum() / (x * x).sum())
    if beta < 0:  # noise: time falling with size; best constant instead
        alpha, beta = float(t.mean()), 0.0
    residual = float(((t - design @ np.array([alpha, beta])) ** 2).sum())
    total = float(((t - t.mean()) ** 2).sum())
    return AlphaBeta(float(alpha), float(beta), 1.0 - residual / total if total > 0 else 1.0)

