"""Routing traces: per iteration and MoE layer, the token count matrix [source, expert].

Input for the load balancers (FlexMoE's and Pro-Prophet's planners read such loads) and the
cluster simulator. A *source* is a data-parallel rank: its micro-batches of the iteration (the
same tokens on each of its TP ranks, counted once). ``counts[i, l, s, e]`` = (token, expert)
assignments that source s routed to expert e in MoE layer l at iteration i, before capacity
drops; ``dropped[i, l, s]`` = how many of them capacity dropped (0 when dropless). Summed over
sources and experts a layer's counts are ``global_batch_size * seq_length * top_k``.

On disk, `<run_dir>/routing/`, written by rank 0 only:

* ``header.json``: {"format": "megatron_moe.routing_trace", "version": 1, "num_moe_layers",
  "moe_layer_indices" (transformer layer of each MoE layer), "num_sources", "num_experts",
  "top_k", "tokens_per_iteration", "chunk_iters"};
* ``counts_<first iteration, 8 digits>.npz`` (numpy, zip-compressed), one per chunk of up to
  ``chunk_iters`` iterations: ``iterations`` int64 [n], ``counts`` int32 [n, L, S, E],
  ``dropped`` int32 [n, L, S], and (version 2) ``micro_counts`` int32 [n, L, S, M, E]: the same
  counts per micro-batch of the source (M = micro-batches per data-parallel rank and iteration,
  summing to ``counts``), which capacity drops and the balancers' per-forward plans depend on
  (the cluster simulator replays them, `megatron_moe/sim/`).

Version 1 traces (no ``micro_counts``) still load; `RoutingTrace.micro_counts` is then None.

A run resumed from a checkpoint writes into the same directory and replaces the trace from its
first iteration on (later chunks are deleted, a chunk straddling it is cut), so the directory
always holds one consistent history.
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import List, Optional

import numpy as np

FORMAT, VERSION = "megatron_moe.routing_trace", 2
READABLE_VERSIONS = (1, 2)
CHUNK_ITERS = 100


@dataclass
class RoutingTrace:
    header: dict
    iterations: np.ndarray  # int64 [I], ascending
    counts: np.ndarray  # int32 [I, L, S, E]
    dropped: np.ndarray  # int32 [I, L, S]
    micro_counts: Optional[np.ndarray] = None  # int32 [I, L, S, M, E] per micro-batch (version 2), or None

    def expert_load(self) -> np.ndarray:
        """int64 [I, L, E]: assignments per expert, summed over sources."""
        return self.counts.sum(axis=2, dtype=np.int64)


class RoutingTraceWriter:
    """Buffers one [L, S, E] matrix per iteration; writes a chunk every `chunk_iters` and on close."""

    def __init__(self, directory: str, header: dict, chunk_iters: int = CHUNK_ITERS):
        self.directory, self.chunk_iters = directory, chunk_iters
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "header.json"), "w") as f:
            json.dump({"format": FORMAT, "version": VERSION, **header, "chunk_iters": chunk_iters}, f, indent=1)
        self._iterations: List[int] = []
        self._counts: List[np.ndarray] = []
        self._dropped: List[np.ndarray] = []
        self._micro: List[np.ndarray] = []
        self._first: Optional[int] = None

    def append(self, iteration: int, counts: np.ndarray, dropped: np.ndarray, micro_counts: np.ndarray) -> None:
        """counts [L, S, E], dropped [L, S], micro_counts [L, S, M, E] of one iteration."""
        if self._first is None:
            self._first = iteration
            _truncate(self.directory, iteration)
        self._iterations.append(iteration)
        self._counts.append(counts.astype(np.int32))
        self._dropped.append(dropped.astype(np.int32))
        self._micro.append(micro_counts.astype(np.int32))
        if len(self._iterations) >= self.chunk_iters:
            self.flush()

    def flush(self) -> None:
        if not self._iterations:
            return
        path = os.path.join(self.directory, f"counts_{self._iterations[0]:08d}.npz")
        np.savez_compressed(path, iterations=np.array(self._iterations, dtype=np.int64),
                            counts=np.stack(self._counts), dropped=np.stack(self._dropped),
                            micro_counts=np.stack(self._micro))
        self._iterations, self._counts, self._dropped, self._micro = [], [], [], []

    close = flush


def _chunk_paths(directory: str) -> List[str]:
    return sorted(glob.glob(os.path.join(directory, "counts_*.npz")))


def _truncate(directory: str, iteration: int) -> None:
    """Remove iterations >= `iteration` from the chunks in `directory`."""
    for path in _chunk_paths(directory):
        with np.load(path) as chunk:
            keep = chunk["iterations"] < iteration
            if keep.all():
                continue
            arrays = {name: chunk[name][keep] for name in chunk.files}
        os.remove(path)
        if keep.any():
            np.savez_compressed(path, **arrays)


def load_routing_trace(directory: str, first: Optional[int] = None, last: Optional[int] = None) -> RoutingTrace:
    """Read a trace directory (optionally only iterations first..last, inclusive)."""
    header_path = os.path.join(directory, "header.json")
    if not os.path.exists(header_path):
        raise ValueError(f"{directory} is not a routing trace (no header.json)")
    with open(header_path) as f:
        header = json.load(f)
    if header.get("format") != FORMAT or header.get("version") not in READABLE_VERSIONS:
        raise ValueError(f"{header_path}: not a {FORMAT} version {' or '.join(map(str, READABLE_VERSIONS))} header")
    chunks = [dict(np.load(p)) for p in _chunk_paths(directory)]
    if not chunks:
        raise ValueError(f"routing trace {directory} has no counts_*.npz chunks")
    iterations = np.concatenate([c["iterations"] for c in chunks])
    keep = np.ones(len(iterations), dtype=bool)
    if first is not None:
        keep &= iterations >= first
    if last is not None:
        keep &= iterations <= last
    micro = np.concatenate([c["micro_counts"] for c in chunks])[keep] if all("micro_counts" in c for c in chunks) \
        else None
    return RoutingTrace(header, iterations[keep], np.concatenate([c["counts"] for c in chunks])[keep],
                        np.concatenate([c["dropped"] for c in chunks])[keep], micro)
