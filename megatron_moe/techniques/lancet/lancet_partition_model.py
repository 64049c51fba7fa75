"""Lancet's partition range selection (Jiang et al., MLSys'24, §5.1 and §5.3), as pure Python.

The forward pass is a sequence of N instructions, here the model's sublayers in order
(`attention`, `ffn` of layer 0, `attention`, `ffn` of layer 1, ...); an MoE FFN is one instruction
whose cost has a compute part and two all-to-alls. A *segment* [i, n) of instructions run as k batch
parts costs P(i, n, k); the dynamic program of §5.1 picks the segments and their k:

    T(0) = 0,    T(n) = min_{0 <= i < n} { T(i) + min_{1 <= k <= K} P(i, n, k) }        (§5.1)

P(i, n, 1) is the plain time (the sum). A segment may be partitioned (k > 1) only when it holds
exactly one MoE FFN: the eager pipeline (techniques/lancet/lancet_partition.py) overlaps that layer's
all-to-alls with the parts' non-MoE computation; other segments have P = inf for k > 1 (Lancet's
"no valid way to partition").

P(i, n, k) for a partitionable segment is the end of a simulated timeline (§5.3: every
instruction starts at the latest of the end of what it depends on and the end of the previous
instruction of its kind, compute or communication), in the order the eager pipeline issues them:

    A_0; for q = 0..k-1: D_q (A_{q+1} while D_q is in flight) X_q C_q (B_{q-1} while C_q is in flight); B_{k-1}

with A = the segment's instructions before the MoE FFN (one part), D / C = the dispatch / combine
all-to-all of one part, X = the MoE layer's compute for one part (norm, gate, experts), B = the
instructions after it. Op times per part come from measurement at the part's size
(`techniques/lancet/lancet_partition.py` profiles every sublayer at 1..k parts, the MoE FFN's all-to-alls
included), where Lancet's cost model (§3) queries the whole all-to-all's profile at C/k.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np


@dataclass(frozen=True)
class MoECost:
    """One part's MoE FFN costs when the micro-batch is split into k parts (seconds)."""

    compute: float  # norm, gate, experts and the layer's local work
    dispatch: float  # the dispatch all-to-all
    combine: float  # the combine all-to-all


@dataclass(frozen=True)
class Instruction:
    """One sublayer. `times[k]`: seconds for one of k parts (k = 1: the whole micro-batch);
    `moe[k]`: the same for an MoE FFN, split into compute and all-to-alls (None for other ops)."""

    name: str
    times: Dict[int, float]
    moe: Optional[Dict[int, MoECost]] = None

    def total(self, k: int) -> float:
        """Seconds of one part, communication included, nothing overlapped."""
        if self.moe is None:
            return self.times[k]
        cost = self.moe[k]
        return cost.compute + cost.dispatch + cost.combine


def pipeline_time(parts: int, before, moe: MoECost, after):
    """The timeline of one partitioned segment (module docstring) -> its end. The times may be
    numpy arrays (one timeline per element: the cluster simulator's ranks)."""
    compute, comm_free = before, 0.0  # A_0
    for q in range(parts):
        d_end = np.maximum(compute, comm_free) + moe.dispatch
        comm_free = d_end
        if q + 1 < parts:
            compute = compute + before  # A_{q+1} while D_q is in flight
        compute = np.maximum(compute, d_end) + moe.compute  # X_q
        c_end = np.maximum(compute, comm_free) + moe.combine
        comm_free = c_end
        if q >= 1:
            compute = compute + after  # B_{q-1} while C_q is in flight
        compute = np.maximum(compute, c_end)
    return compute + after  # B_{k-1}


def segment_time(instructions: Sequence[Instruction], start: int, end: int, parts: int) -> float:
    """P(start, end, parts): seconds of instructions [start, end) run as `parts` batch parts."""
    ops = instructions[start:end]
    if parts == 1:
        return sum(op.total(1) for op in ops)
    moe = [i for i, op in enumerate(ops) if op.moe is not None]
    if len(moe) != 1 or any(parts not in op.times and op.moe is None for op in ops):
        return math.inf
    m = moe[0]
    before = sum(op.times[parts] for op in ops[:m])
    after = sum(op.times[parts] for op in ops[m + 1:])
    if parts not in ops[m].moe:
        return math.inf
    return pipeline_time(parts, before, ops[m].moe[parts], after)


@dataclass(frozen=True)
class Segment:
    """Instructions [start, end) run as `parts` batch parts; `moe`: the MoE FFN among them."""

    start: int
    end: int
    moe: int
    parts: int


def best_partitioning(instructions: Sequence[Instruction], max_parts: int,
                      max_range: Optional[int] = None) -> Tuple[float, List[Segment]]:
    """§5.1's dynamic program -> (T(N), the partitioned segments (parts > 1), in order).
    `max_range`: longest segment in instructions (Lancet's iota; None = no limit)."""
    n_ops = len(instructions)
    best = [0.0] + [math.inf] * n_ops  # T(n)
    choice: List[Optional[Tuple[int, int]]] = [None] * (n_ops + 1)  # (i, k) reaching T(n)
    for n in range(1, n_ops + 1):
        lowest = 0 if max_range is None else max(0, n - max_range)
        for i in range(lowest, n):
            for k in range(1, max_parts + 1):
                cost = best[i] + segment_time(instructions, i, n, k)
                if cost < best[n] - 1e-15:
                    best[n], choice[n] = cost, (i, k)
    segments, n = [], n_ops
    while n > 0:
        i, k = choice[n]
        if k > 1:
            moe = next(j for j in range(i, n) if instructions[j].moe is not None)
            segments.append(Segment(i, n, moe, k))
        n = i
    return best[n_ops], segments[::-1]


def partition_max_range(max_range: Optional[int], spacing: int) -> int:
    """`moe.lancet.max_range` (Lancet's iota, §5.1 / §7: "the execution time between two MoE
    layers, so one pipeline will be formed per MoE layer"); null = 2 x `spacing` instructions, from
    one MoE FFN to the next (`spacing`: layers between them, model/transformer.py `moe_layer_spacing`)."""
    return max_range if max_range is not None else 2 * spacing


def fixed_partitioning(is_moe: Sequence[bool], parts: int, reach: int) -> List[Segment]:
    """`moe.lancet.partition_range: N`: every MoE FFN with up to `reach` instructions before and
    after it, as `parts` parts. Instructions between two MoE FFNs go to the earlier one's range
    first; no instruction belongs to two segments."""
    moe_ops = [i for i, m in enumerate(is_moe) if m]
    segments, taken = [], 0  # instructions before `taken` belong to earlier segments
    for j, m in enumerate(moe_ops):
        limit = moe_ops[j + 1] if j + 1 < len(moe_ops) else len(is_moe)
        start = max(taken, m - reach)
        end = min(limit, m + reach + 1)
        segments.append(Segment(start, end, m, parts))
        taken = end
    return segments
