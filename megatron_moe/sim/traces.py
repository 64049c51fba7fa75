"""Routing for the simulator, planners and benchmarks: how many rows each source routes to each expert.

A simulated iteration needs, per MoE layer, the assignments each data-parallel source routes to
each expert, before capacity drops: counts [L, S, E], as a routing trace records them
(`moe/routing_trace.py`), and optionally per micro-batch [L, S, M, E] (traces written since
version 2). Sources:

* `RecordedTrace`: a `logging.routing_trace` directory, replayed; its sources are mapped onto the
  simulated data-parallel ranks (split evenly when the layout has k times as many, summed when
  it has k times fewer), its rows rescaled to the simulated model's when they differ (largest
  remainders, so every source keeps its exact total);
* `SyntheticTrace`: ``uniform``, ``zipf:S`` (popularity p_k ~ 1 / k^S in a random expert order,
  fixed), ``drift:S:D`` (Zipf(S) whose log-popularity takes a Gaussian random walk of step D per
  iteration: adjacent iterations look alike, as Pro-Prophet's Fig. 4 and FlexMoE §2.4 observe,
  while the hot experts change over hundreds of iterations). Each source's mix is a multinomial
  draw from the layer's popularity.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import numpy as np

from megatron_moe.moe.routing_trace import load_routing_trace

Step = Tuple[int, np.ndarray, Optional[np.ndarray]]  # iteration, counts [L, S, E], micro counts [L, S, M, E] or None


def zipf_rows(rng: np.random.Generator, experts: int, devices: int, rows: int, skew: float) -> np.ndarray:
    """T Long[D, E]: every device routes `rows` rows (tokens x top-k); expert popularity is
    Zipf(`skew`), p_k ~ 1 / k^skew, in a random expert order shared by the devices, and each
    device's mix is a multinomial draw from it (skew 0: uniform)."""
    return multinomial_rows(rng, rng.permutation(zipf_popularity(experts, skew)), devices, rows)


def zipf_popularity(experts: int, skew: float) -> np.ndarray:
    """Float[E]: p_k ~ 1 / k^skew, most popular first, summing to 1."""
    popularity = 1.0 / np.arange(1, experts + 1) ** skew
    return popularity / popularity.sum()


def multinomial_rows(rng: np.random.Generator, popularity: np.ndarray, devices: int, rows: int) -> np.ndarray:
    """Long[D, E]: `rows` rows per device, each device's mix a multinomial draw from `popularity`."""
    return rng.multinomial(rows, popularity, size=devices).astype(np.int64)


def largest_remainder(counts: np.ndarray, total: int) -> np.ndarray:
    """counts [..., E] rescaled to sum to `total` along the last axis (floors, then one each to the
    largest remainders; ties: the lower index)."""
    counts = np.asarray(counts, dtype=np.float64)
    sums = counts.sum(-1, keepdims=True)
    exact = np.divide(counts * total, sums, out=np.full_like(counts, total / counts.shape[-1]), where=sums > 0)
    out = np.floor(exact).astype(np.int64)
    short = total - out.sum(-1)
    order = np.argsort(-(exact - out), axis=-1, kind="stable")
    rank = np.argsort(order, axis=-1, kind="stable")
    return out + (rank < short[..., None])


def split_even(counts: np.ndarray, parts: int) -> np.ndarray:
    """counts [..., E] -> [..., parts, E]: each count dealt over `parts` evenly (the first
    count % parts parts one more), as Parm S2 deals an expert's rows over the TP ranks."""
    counts = np.asarray(counts, dtype=np.int64)[..., None, :]
    index = np.arange(parts)[:, None]
    return counts // parts + (index < counts % parts)


@dataclass
class SyntheticTrace:
    """Synthetic routing (module docstring). `rows`: assignments per source per iteration."""

    kind: str  # "uniform" | "zipf:S" | "drift:S:D"
    num_layers: int
    num_sources: int
    num_experts: int
    rows: int
    iterations: int
    seed: int = 0

    def __post_init__(self):
        parts = self.kind.split(":")
        try:
            if parts[0] == "uniform" and len(parts) == 1:
                self.skew, self.drift = 0.0, 0.0
            elif parts[0] == "zipf" and len(parts) == 2:
                self.skew, self.drift = float(parts[1]), 0.0
            elif parts[0] == "drift" and len(parts) == 3:
                self.skew, self.drift = float(parts[1]), float(parts[2])
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"--trace {self.kind!r}: expected uniform, zipf:S or drift:S:D (S: Zipf exponent, "
                             "D: random-walk step of the log-popularity per iteration)") from None

    def steps(self) -> Iterator[Step]:
        rng = np.random.default_rng(self.seed)
        logp = np.log(np.stack([rng.permutation(zipf_popularity(self.num_experts, self.skew))
                                for _ in range(self.num_layers)]))  # [L, E]
        for it in range(1, self.iterations + 1):
            if it > 1 and self.drift:
                logp = logp + rng.normal(0.0, self.drift, logp.shape)
            p = np.exp(logp - logp.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            counts = np.stack([multinomial_rows(rng, p[layer], self.num_sources, self.rows)
                               for layer in range(self.num_layers)])
            yield it, counts, None


class RecordedTrace:
    """A `logging.routing_trace` directory mapped onto `num_sources` sources of `rows` each."""

    def __init__(self, directory: str, num_sources: int, rows: int, num_experts: int,
                 first: Optional[int] = None, last: Optional[int] = None):
        trace = load_routing_trace(directory, first, last)
        header = trace.header
        if header["num_experts"] != num_experts:
            raise ValueError(f"trace {directory} has {header['num_experts']} experts, the model {num_experts}")
        self.trace, self.num_layers, self.num_experts = trace, trace.counts.shape[1], num_experts
        self.num_sources, self.rows = num_sources, rows
        recorded = trace.counts.shape[2]
        if num_sources % recorded and recorded % num_sources:
            raise ValueError(f"trace {directory} has {recorded} sources; the simulated layout has {num_sources} "
                             "data-parallel ranks: one must divide the other")

    def _fit(self, counts: np.ndarray) -> np.ndarray:
        """[L, S_rec, E] -> [L, S, E] with `rows` per source."""
        L, recorded, E = counts.shape
        if self.num_sources > recorded:
            counts = split_even(counts, self.num_sources // recorded).reshape(L, self.num_sources, E)
        elif self.num_sources < recorded:
            counts = counts.reshape(L, self.num_sources, recorded // self.num_sources, E).sum(2)
        counts = counts.astype(np.int64)
        return counts if (counts.sum(-1) == self.rows).all() else largest_remainder(counts, self.rows)

    def steps(self) -> Iterator[Step]:
        micro = self.trace.micro_counts
        for i, it in enumerate(self.trace.iterations.tolist()):
            counts = self._fit(self.trace.counts[i])
            # micro-batch detail only replays as is (a rescaled or remapped trace deals its counts evenly)
            exact = micro is not None and counts.shape[1] == micro.shape[2] and \
                (counts == micro[i].sum(2)).all()
            yield int(it), counts, micro[i].astype(np.int64) if exact else None
