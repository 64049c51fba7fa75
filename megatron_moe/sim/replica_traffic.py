"""Simulated expert-weight traffic: per-iteration replicas (*Trans* / *Agg*, `moe/replicas.py`) and
persistent vExperts (gradient sum and moves, `moe/vexperts.py`), as `Op`s on the ``ep`` groups.

Every ESP shard rank j of an ep_esp group moves its own shard (Q elements) on its ep group (Trans
and Agg on its side channel, counted under ``ep_side`` as in training, where `SIDE_CHANNELS`
builds one); w = the weights' width (`Widths.weight`: 2 in bf16 runs, else 4), gradients are fp32
main gradients:

    Trans  expert on every EP rank (FasterMoE's shadow): a broadcast from the owner per parameter
           tensor; the owner counts Q x w x (ep - 1) bytes ("trans/ep_side"). Otherwise point to point:
           the owner sends Q x w bytes to each replica.
    Agg    the adjoint: a reduce to the owner (every other rank counts Q x 4), or each replica
           sends Q x 4 bytes to the owner ("agg/ep_side").
    vExpert gradients: among each expert's k holders (FlexMoE Eq. 9), two rounds of point-to-point
           messages on ep (`vexperts.grad_sum_traffic`): each holder sends each chunk's root its
           part (about Q / k x 4 bytes), then each root sends the other holders its summed chunk
           ("vexpert_grad/ep"), once per iteration: 2 (k - 1) / k x Q x 4 bytes per holder. A
           rank holding no replicated expert sends nothing and spends nothing.
    vExpert moves: `vexpert_moves.plan_transfers` (the transfers `MovesInFlight` posts) between the
           old and new slots; each transfer's source sends Q (x 3 with AdamW's two moments) x 4
           bytes ("vexpert_move/ep").
"""
from __future__ import annotations

from dataclasses import replace
from typing import List

import numpy as np

from megatron_moe.moe.vexpert_moves import plan_transfers
from megatron_moe.moe.vexperts import grad_sum_traffic
from megatron_moe.sim.ops import Op, OpBuilder, Traffic, profile_elements

SIDE = "ep_side"  # the group name Trans / Agg count under (`Group.side_channel()`, moe/replicas.py)


def _per_ep_group(b: OpBuilder, per_ep_esp_group: List[np.ndarray]) -> np.ndarray:
    """[ep_esp groups][ep, ep] -> [ep groups, ep, ep]: every shard rank j of a group does the same."""
    return np.stack([m for m in per_ep_esp_group for _ in range(b.world.layout.expert_shard)])


def replica_ops(b: OpBuilder, placements: list, params: int, tensors: int, handle: str,
                backward: bool) -> List[Op]:
    """Trans (forward) or Agg (`backward`) of `placements` (`moe_layer.Executed`, one per ep_esp group) as issue ops on
    the side channel `handle`: the broadcast / reduce experts one after the other, then the
    point-to-point batch."""
    world, cluster = b.world, b.cluster
    ep = world.layout.expert
    members = b.members("ep")  # [ep groups, ep]
    owned = b.zeros()  # broadcast experts each rank owns
    everywhere = b.zeros()  # broadcast experts in each rank's ep group
    pairs = []  # [ep_esp groups][ep, ep] elements owner -> replica
    for g, placement in enumerate(placements):
        P = np.zeros((ep, ep))
        shared = 0
        for ranks in placement.replicas:
            if len(ranks) == 1:
                continue
            if len(ranks) == ep:
                shared += 1
                for j in range(world.layout.expert_shard):
                    owned[members[g * world.layout.expert_shard + j, ranks[0]]] += 1
            else:
                P[ranks[0], list(ranks[1:])] += params
        pairs.append(P)
        for j in range(world.layout.expert_shard):
            everywhere[members[g * world.layout.expert_shard + j]] = shared
    ops = []
    if everywhere.any():
        kind = "agg" if backward else "trans"
        link = cluster.link("reduce" if backward else "broadcast")
        spans = world.spans_nodes["ep"]
        ab = [(link.inter or link.intra) if s else link.intra for s in spans]
        alpha = np.array([a.alpha for a in ab])
        beta = np.array([a.beta for a in ab])
        width = 4 if backward else b.widths.weight
        cost_all = everywhere * (tensors * alpha + beta * profile_elements(params, width))
        counted = (everywhere - owned) * params * width if backward else owned * params * width * (ep - 1)
        ops.append(Op(kind, "issue", lambda k, c=cost_all: c / k, "ep", [Traffic(f"{kind}/{SIDE}", counted)], handle))
    P = _per_ep_group(b, pairs)
    if P.any():
        kind = "agg" if backward else "trans"
        op = b.exchange(kind, kind, "ep", P.transpose(0, 2, 1) if backward else P, 4 if backward else b.widths.weight,
                        counts_own=False, cost_kind="p2p", mode="issue", handle=handle)
        ops.append(replace(op, traffic=[replace(t, key=f"{kind}/{SIDE}") for t in op.traffic]))
    return ops


def vexpert_grad_op(b: OpBuilder, slots: np.ndarray, num_experts: int, params: int) -> List[Op]:
    """`sync_replica_grads`: round 1 (holders -> each chunk's root) and round 2 (roots -> holders)
    of every expert held by more than one EP rank, `params` fp32 elements per expert. Each
    round is a batch of point-to-point messages priced per rank (`Cluster.exchange` "p2p": the
    larger of what it sends and receives): a holder pays for its own messages, a rank with none
    pays nothing and waits for no one (not modelled: a root waiting for a later holder; the next
    collective on the group absorbs that skew)."""
    ep = b.world.layout.expert
    if ep == 1:
        return []
    P = grad_sum_traffic(slots, num_experts, params)
    if not P.any():
        return []
    groups = b.members("ep").shape[0]
    return [replace(b.exchange("vexpert_grad", "vexpert_grad", "ep", np.broadcast_to(m, (groups, ep, ep)), 4,
                               counts_own=False, cost_kind="p2p"), group="")  # per rank: no ep-wide wait
            for m in (P, P.T)]


def vexpert_move_op(b: OpBuilder, old: np.ndarray, new: np.ndarray, width: int, element_bytes: int,
                    handle: str = "") -> List[Op]:
    """The moves from `old` to `new` slots [ep, V]: `width` elements of `element_bytes` per transfer
    (each between ranks); with `handle`, issued asynchronously on that side channel (best-effort)."""
    ep = b.world.layout.expert
    P = np.zeros((ep, ep))
    for t in plan_transfers(old, new):
        P[t.src_rank, t.dst_rank] += width
    if not P.any():
        return []
    groups = b.members("ep").shape[0]
    return [b.exchange("vexpert_move", "vexpert_move", "ep", np.broadcast_to(P, (groups, ep, ep)), element_bytes,
                       counts_own=False, cost_kind="p2p", mode="issue" if handle else "sync", handle=handle)]
