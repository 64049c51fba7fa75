"""Work that crosses MoE layers within one forward pass: Pro-Prophet's block-wise scheduler
(Wang et al., §V, Alg. 2; `moe.proprophet.overlap: true`). The one place where a layer reaches
into the next one — the model code only links the layers (model/transformer.py `link_moe_layers`,
from `run_layers`); the MoE layer calls this module as its balancer's `cross_layer`
(moe/balancers/base.py). Lancet's cross-layer scheduling belongs here too.

A *block* i is MoE layer i and the non-MoE computation after it, up to MoE layer i+1. With the
plan for this iteration known before it starts (locality, §II-B: searched on an earlier forward),
the replicas of layer i+1 are known while block i runs, so its *Trans* is issued early, split in
two sub-transfers (Alg. 2 lines 4, 7, 9):

    SubTrans1_{i+1}: issued right before FEC_i (layer i's expert computation)
    SubTrans2_{i+1}: issued right after MoE layer i, during FNEC_i (the non-MoE part)

SubTrans1 takes the replicated experts (ascending id) whose Eq. 4 times fit T_FEC_i (the model's
estimate from layer i's loads), SubTrans2 the rest; layer i+1 waits for both only when its experts
run. Both travel on `ep`'s side channel (`start_trans`, moe/replicas.py), so on NCCL they run
beside layer i's combine and layer i+1's dispatch all-to-alls instead of ahead of them.
`Plan_i^{j+1}` runs while layer i's dispatch all-to-all is in flight (line 6, `RunHooks`).

*Agg* of layer i+1 is partitioned likewise (line 5) and issued by block i's backward, which runs
BNEC_i, A2A_i (combine), BEC_i, A2A_i (dispatch) (lines 12-15):

    SubAgg1_{i+1}: issued once layer i+1's input has its whole gradient, i.e. after layer i+1's
                   dispatch all-to-all in backward, as BNEC_i starts (line 12, `layer_input`)
    SubAgg2_{i+1}: issued once layer i's expert output has its gradient, i.e. after line 13's
                   all-to-all, as BEC_i starts (line 14, `experts_output`)

SubAgg1 takes the replicated experts (ascending id) whose Eq. 5 times fit T_BNEC = 2 T_FNEC (static,
§V-B), SubAgg2 the rest (`split_agg`). Layer i+1's Trans backward (during its expert backward) only
hands its operations to the layer's `SplitAgg` (`moe/replicas.py`). Both parts travel on the side
channel of `ep`, as Trans did (`SIDE_CHANNELS`, registered in proprophet.py), so on NCCL they
never queue ahead of an all-to-all on `ep`'s communicator; they are waited on at the end of
backward. Their bytes count as "agg/ep_side", tagged SubAgg1 / SubAgg2 (`COMM_STATS.tagged`).
Under FasterMoE's smart schedule the experts' output is the pipelined steps' output: SubAgg2 goes
out as layer i's backward starts.

The first MoE layer of a forward has no block before it: its Trans is issued by its own layer,
as without the scheduler; so is every Trans of a forward that has no plan yet (the first), and of
a Lancet batch part after the first. Those layers issue their Agg whole, in Trans's backward, as
without the scheduler: on `ep`'s side channel too (every Trans and Agg is, `moe/replicas.py`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import numpy as np
import torch

from megatron_moe.distributed.collectives import TimeSink
from megatron_moe.moe.replicas import ReplicaWeights, SplitAgg, start_trans


@dataclass
class Prefetched:
    """Trans of one layer issued by the block before it: the replicas it serves and its parts;
    the layer's Agg, which the block before issues in two parts in backward."""

    replicas: Tuple[Tuple[int, ...], ...]
    parts: List[Optional[ReplicaWeights]]
    agg: Optional[SplitAgg] = None


def _at_backward(x: torch.Tensor, fn: Callable[[], None]) -> torch.Tensor:
    """x, as a tensor of its own whose gradient, once complete, first runs `fn` (an issue point in
    the backward pass: every use of the result has back-propagated into it)."""
    if not x.requires_grad:
        return x
    y = x.view_as(x)
    y.register_hook(lambda grad: fn())  # (returns None: the gradient passes unchanged)
    return y


def _replicas_of(selections, num_experts: int, ep_size: int) -> Tuple[Tuple[int, ...], ...]:
    per_rank = num_experts // ep_size
    replicas = [(e // per_rank,) for e in range(num_experts)]
    for e, devices in selections:
        replicas[e] = tuple(devices)
    return tuple(replicas)


def split_trans(selections, model, devices: int, budget_seconds: float) -> int:
    """How many of `selections` (sorted by expert) SubTrans1 takes: the longest prefix whose Eq. 4
    time fits `budget_seconds` (T_FEC of the block before). SubAgg1 likewise (Eq. 5 = Eq. 4 here)
    within T_BNEC (`split_agg`)."""
    spent = 0.0
    for count, (_, devs) in enumerate(selections):
        spent += model.trans(len(devs) - 1, devices)
        if spent > budget_seconds:
            return count
    return len(selections)


def split_agg(selections, model, devices: int) -> int:
    """How many of `selections` (sorted by expert) SubAgg1 takes: the longest prefix whose Eq. 5
    time fits T_BNEC = 2 T_FNEC (§V-B: static, estimated before training; Eq. 3's factor 2)."""
    return split_trans(selections, model, devices, 2 * model.fnec_seconds)


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
    agg = SplitAgg(e for e, _ in selections[:split_agg(selections, model, nxt.balancer.ep_size)])
    nxt.prefetched = Prefetched(replicas, [start_trans(nxt.experts, first, nxt.state, nxt.replica_times)], agg)
    nxt.prefetched_rest = selections[cut:]


def experts_output(layer, y: torch.Tensor) -> torch.Tensor:
    """Alg. 2 line 14: SubAgg2 of the next MoE layer goes out when this layer's expert output gets
    its gradient, after this layer's combine all-to-all in backward (line 13), as BEC_i starts."""
    nxt = _scheduler(layer)
    if nxt is None or nxt.prefetched is None or nxt.prefetched.agg is None:
        return y
    return _at_backward(y, functools.partial(nxt.prefetched.agg.issue, 2))


def layer_input(layer, x: torch.Tensor) -> torch.Tensor:
    """Alg. 2 line 12: SubAgg1 of this layer goes out when its input gradient is complete (after its
    dispatch all-to-all in backward), as BNEC_i of the block before starts."""
    if layer.prefetched is None or layer.prefetched.agg is None:
        return x
    return _at_backward(x, functools.partial(layer.prefetched.agg.issue, 1))


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
    weights = ReplicaWeights.joined(prefetched.parts)
    if weights is not None and prefetched.agg is not None:
        weights.split_agg(prefetched.agg)
    return weights
