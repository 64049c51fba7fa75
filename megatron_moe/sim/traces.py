"""Synthetic routing distributions: how many rows each device (EP rank) routes to each expert."""
from __future__ import annotations

import numpy as np


def zipf_rows(rng: np.random.Generator, experts: int, devices: int, rows: int, skew: float) -> np.ndarray:
    """T Long[D, E]: every device routes `rows` rows (tokens x top-k); expert popularity is
    Zipf(`skew`), p_k ~ 1 / k^skew, in a random expert order shared by the devices, and each
    device's mix is a multinomial draw from it (skew 0: uniform)."""
    popularity = 1.0 / np.arange(1, experts + 1) ** skew
    popularity = rng.permutation(popularity / popularity.sum())
    return np.stack([rng.multinomial(rows, popularity) for _ in range(devices)]).astype(np.int64)
