"""Straightforward dense references for the planners' per-forward routing, which the package
computes sparsely (over (expert, holder) pairs, incrementally). Written over the whole
[sources, experts, ranks] cube, as the papers state them; they share no code with the package.

    dense_flexible_routing(counts, source_ranks, slots)  FlexMoE Alg. 3 -> Float[S, E, G]
    dense_integer_routing(fractions, counts, allowed)    largest remainders per (s, e) -> Int[S, E, G]
    dense_rank_times(cost, counts, slots)                FlexMoE Eq. 5 from the dense routing -> Float[G]
    scatter_pairs(routing, num_ranks)                    a `PairRouting` as its dense [S, E, G] table
    reference_shadow_experts(T, cost, min_shadow)        FasterMoE Alg. 1, every candidate's loads from scratch
"""
from __future__ import annotations

from typing import List

import numpy as np
import torch


def _vexperts(slots: np.ndarray, num_experts: int) -> np.ndarray:
    n = np.zeros((slots.shape[0], num_experts), dtype=np.int64)  # [G, E]
    for g in range(slots.shape[0]):
        for e in slots[g][slots[g] >= 0].tolist():
            n[g, e] += 1
    return n


def dense_flexible_routing(counts, source_ranks, slots) -> np.ndarray:
    """FlexMoE Alg. 3 on the dense cube: counts [S, E], source_ranks [S], slots [G, V] -> Float[S, E, G]."""
    counts = np.asarray(counts, dtype=np.float64)
    slots = np.asarray(slots)
    num_ranks, num_experts = slots.shape[0], counts.shape[1]
    source_ranks = np.asarray(source_ranks, dtype=np.int64)
    n = _vexperts(slots, num_experts)
    sent = np.zeros((num_ranks, num_experts))
    np.add.at(sent, source_ranks, counts)  # I_{e,g}
    capacity = n * (sent.sum(0) / n.sum(0))
    local = np.minimum(capacity, sent)
    spill = sent - local
    free = capacity - local
    total_free = free.sum(0)
    share = np.divide(free, total_free, out=np.zeros_like(free), where=total_free > 0)
    per_rank = spill[:, :, None] * share.T[None, :, :]  # [G, E, G]
    per_rank[np.arange(num_ranks), :, np.arange(num_ranks)] += local
    fraction = np.divide(counts, sent[source_ranks], out=np.zeros_like(counts), where=sent[source_ranks] > 0)
    return per_rank[source_ranks] * fraction[:, :, None]


def dense_integer_routing(fractions, counts, allowed) -> np.ndarray:
    """Floors, then the remaining rows of each (s, e) one each to the largest fractional parts among
    the `allowed` [E, G] ranks (ties: the lower rank), sorting over every rank."""
    fractions = np.where(allowed[None], np.maximum(fractions, 0.0), 0.0)
    table = np.floor(fractions).astype(np.int64)
    remainder = np.asarray(counts, dtype=np.int64) - table.sum(2)
    rest = np.where(allowed[None], fractions - table, -1.0)
    order = np.argsort(-rest, axis=2, kind="stable")
    table += np.argsort(order, axis=2, kind="stable") < remainder[:, :, None]
    return table


def dense_rank_times(cost, counts, slots) -> np.ndarray:
    """Eq. 5 per GPU from the dense Alg. 3 table: tokens computed, tokens received from other GPUs."""
    slots = np.asarray(slots)
    num_ranks = slots.shape[0]
    table = dense_flexible_routing(counts, np.arange(num_ranks), slots)  # [G src, E, G dst]
    computed = table.sum(axis=(0, 1))
    received = computed - table[np.arange(num_ranks), :, np.arange(num_ranks)].sum(1)
    held = _vexperts(slots, np.asarray(counts).shape[1]) > 0
    k = held.sum(0)
    sync = 2 * (k - 1) / k * cost.params_per_expert * cost.seconds_per_param_sent
    return computed * cost.seconds_per_token + 4 * received * cost.seconds_per_token_sent + held @ sync


def scatter_pairs(routing, num_ranks: int) -> np.ndarray:
    """A `flexmoe_plan.PairRouting` as the dense Float[S, E, G] table (zeros off its pairs)."""
    num_experts = int(routing.experts.max()) + 1 if routing.experts.size else 0
    out = np.zeros((routing.values.shape[0], num_experts, num_ranks))
    out[:, routing.experts, routing.ranks] = routing.values
    return out


def reference_shadow_experts(T: torch.Tensor, cost, min_shadow: int = 0) -> List[int]:
    """FasterMoE Alg. 1 with every candidate set's loads recomputed from T [ep, E] (owners contiguous)."""
    ep, num_experts = T.shape
    owner = [e // (num_experts // ep) for e in range(num_experts)]

    def loads(shadowed):
        out = [0] * ep
        for e in range(num_experts):
            for w in range(ep):
                out[w if e in shadowed else owner[e]] += int(T[w, e])
        return out

    c_min = cost.lat_imbl(float(max(loads([]))))
    shadowed: List[int] = []
    totals = T.sum(0).tolist()
    for e in sorted(range(num_experts), key=lambda e: (-totals[e], e)):
        c = cost.lat_shadow(len(shadowed) + 1, float(max(loads(shadowed + [e]))))
        if c < c_min or len(shadowed) + 1 <= min_shadow:
            shadowed, c_min = shadowed + [e], c
        else:
            break
    return sorted(shadowed)
