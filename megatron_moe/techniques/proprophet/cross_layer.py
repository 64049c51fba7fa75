"""Work that crosses MoE layers within one forward pass: Pro-Prophet's block-wise scheduler
(Wang et al., §V, Alg. 2; `moe.proprophet.overlap: true`). The one place where a layer reaches
into the next one — the model code only links the layers (model/transformer.py `link_moe_layers`,
from `run_layers`); the MoE layer calls this module as its balancer's `cross_layer`
(moe/balancers/base.py). Lancet's cross-layer scheduling belongs here too.

A *block* i is MoE layer i and the non-MoE computation after it, up to MoE layer i+1. With the
plan for this iteration known before it starts (locality, §III: searched on an earlier forward),
the replicas of layer i+1 are known while block i runs, so its *Trans* is issued early, split in
two sub-transfers (Alg. 2 lines 4, 7, 9):

    SubTrans1_{i+1}: issued right before FEC_i (layer i's expert computation)
    SubTrans2_{i+1}: issued right after MoE layer i, during FNEC_i (the non-MoE part)

SubTrans1 takes the replicated experts (ascending id) whose Eq. 4 times fit T_FEC_i (the model's
estimate from layer i's loads), SubTrans2 the rest; layer i+1 waits for both only when its experts
run. `Plan_i^{j+1}` runs while layer i's dispatch all-to-all is in flight (line 6, `RunHooks`).
*Agg* needs no move here: `moe/replicas.py` already issues it asynchronously the moment layer
i+1's expert backward has produced the replica gradients, so it is in flight through BNEC_i and
BEC_i (lines 12-14) and waited on only at the end of backward.

The first MoE layer of a forward has no block before it: its Trans is issued by its own layer,
as without the scheduler; so is every Trans of a forward that has no plan yet (the first).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

from megatron_moe.distributed.collectives import TimeSink
from megatron_moe.moe.replicas import ReplicaWeights, start_trans


@dataclass
class Prefetched:
    """Trans of one layer issued by the block before it: the replicas it serves and its parts."""

    replicas: Tuple[Tuple[int, ...], ...]
    parts: List[Optional[ReplicaWeights]]


def _replicas_of(selections, num_experts: int, ep_size: int) -> Tuple[Tuple[int, ...], ...]:
    per_rank = num_experts // ep_size
    replicas = [(e // per_rank,) for e in range(num_experts)]
    for e, devices in selections:
        replicas[e] = tuple(devices)
    return tuple(replicas)


def split_trans(selections, model, devices: int, budget_seconds: float) -> int:
    """How many of `selections` (sorted by expert) SubTrans1 takes: the longest prefix whose Eq. 4
    time fits `budget_seconds` (T_FEC of the block before)."""
    spent = 0.0
    for count, (_, devs) in enumerate(selections):
        spent += model.trans(len(devs) - 1, devices)
        if spent > budget_seconds:
            return count
    return len(selections)


def _scheduler(layer):
    """The next layer, if it takes part in the block-wise scheduler, else None."""
    nxt = getattr(layer, "next_moe", None)
    if nxt is None or not getattr(nxt.balancer, "prefetches_trans", False):
        return None
    return nxt


def before_experts(layer, tokens_per_ep_rank) -> None:
    """Alg. 2 line 7: SubTrans1 of the next MoE layer, sized to this layer's T_FEC."""
    nxt = _scheduler(layer)
    if nxt is None or nxt.prefetched is not None or nxt.balancer.upcoming_replicas() is None:
        return  # (already issued: an earlier batch part of this layer did, Lancet's partitioned forward)
    selections = sorted(nxt.balancer.upcoming_replicas())
    replicas = _replicas_of(selections, nxt.balancer.num_experts, nxt.balancer.ep_size)
    model = nxt.balancer.model
    budget = model.fec(np.asarray(tokens_per_ep_rank, dtype=np.int64))
    cut = split_trans(selections, model, nxt.balancer.ep_size, budget)
    first = _replicas_of(selections[:cut], nxt.balancer.num_experts, nxt.balancer.ep_size)
    nxt.replica_times = TimeSink()  # the next layer's forward starts here
    nxt.prefetched = Prefetched(replicas, [start_trans(nxt.experts, first, nxt.state, nxt.replica_times)])
    nxt.prefetched_rest = selections[cut:]


def after_layer(layer) -> None:
    """Alg. 2 line 9: SubTrans2 of the next MoE layer, during this block's non-MoE computation."""
    nxt = _scheduler(layer)
    if nxt is None or nxt.prefetched is None or nxt.prefetched_rest is None:
        return
    rest = _replicas_of(nxt.prefetched_rest, nxt.balancer.num_experts, nxt.balancer.ep_size)
    nxt.prefetched.parts.append(start_trans(nxt.experts, rest, nxt.state, nxt.replica_times))
    nxt.prefetched_rest = None


def take_prefetched(layer, replicas: Tuple[Tuple[int, ...], ...]) -> Optional[ReplicaWeights]:
    """The replica weights the block before issued for `replicas` (None if it issued none).
    Every rank of the group planned the same replicas, so a mismatch is a bug, not a miss."""
    prefetched, layer.prefetched, layer.prefetched_rest = layer.prefetched, None, None
    if prefetched is None:
        return None
    if prefetched.replicas != replicas:
        raise RuntimeError(f"MoE layer {layer.layer_index}: Trans was prefetched for replicas {prefetched.replicas} "
                           f"but the placement has {replicas}")
    return ReplicaWeights.joined(prefetched.parts)
