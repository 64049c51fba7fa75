"""Per-iteration expert replicas: *Trans* and *Agg* (FasterMoE §4.1 shadowing, Pro-Prophet §IV
lightweight placements), shared by every balancer whose Placement adds replicas.

When a Placement lists EP rank q as a replica of expert e (owner p = `owner_of(e)`), q computes
e's rows with p's *current* weights:

* **Trans** (forward): ESP shard rank j of p sends its shard of every parameter of e
  (`Experts.stacks()`: w1, w2 and the biases) to shard rank j of q, over the `ep` group (counted
  as "trans"): a broadcast when e is replicated on every EP rank (FasterMoE's shadows), point to
  point otherwise. It is issued asynchronously before the token all-to-all (`Schedule.run`) and
  waited on when the experts run, so the two transfers overlap.
* **Agg** (Trans's backward): the replicas' gradients are summed into p's (a reduce for a
  broadcast expert, point to point otherwise; "agg"), asynchronously; p adds the sums into its
  parameters' `.grad` when the backward pass ends (autograd's `queue_callback`), so Agg overlaps
  the rest of backward. Only the owner holds optimizer state and is checkpointed; replicas live
  for one forward.

Every rank that owns or holds a replica takes part in both. A rank computes its replica rows
even when it has none, so that Trans's backward runs everywhere and Agg is matched on both sides
(`Experts.forward`). Every rank issues the operations in the same order: broadcast experts
ascending, each parameter in `stacks()` order, then one batch of point-to-point messages (per
expert ascending, per replica rank ascending, per parameter), which pairs of ranks match in
posting order.

Bytes (collectives.py's convention): Trans counts shard_params(e) x 4 bytes (fp32) at the owner
for every (replicated expert, receiver); Agg the same at every replica
(`tests/distributed/test_replicas.py` checks the formula).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.parallel_state import Group, ParallelState
from megatron_moe.moe.placement import Placement

TRANS_KIND = "trans"
AGG_KIND = "agg"


@dataclass
class ReplicaPlan:
    """This rank's part of a Placement's replicas."""

    ep_rank: int
    first_expert: int  # global id of this rank's first owned expert
    replicas: Tuple[Tuple[int, ...], ...]  # Placement.replicas: owner first
    expert_ids: List[int]  # experts this rank computes as a replica, ascending
    pending: List[C.Pending] = field(default_factory=list, repr=False)  # Trans in flight

    @classmethod
    def of(cls, placement: Placement, ep_rank: int, num_local: int) -> "ReplicaPlan":
        return cls(ep_rank, ep_rank * num_local, placement.replicas, placement.replicas_on(ep_rank))

    def involved(self) -> List[int]:
        """Replicated experts this rank owns or holds a replica of, ascending."""
        return [e for e, ranks in enumerate(self.replicas) if len(ranks) > 1 and self.ep_rank in ranks]


def _operations(plan: ReplicaPlan, ep_size: int, num_params: int):
    """(expert, parameter index, owner, other replica ranks, by collective?) for every replicated
    expert this rank is involved in and every parameter, in the order every rank issues them."""
    for e in plan.involved():
        ranks = plan.replicas[e]
        for i in range(num_params):
            yield e, i, ranks[0], ranks[1:], len(ranks) == ep_size


class _Trans(torch.autograd.Function):
    """forward: owned stacks -> this rank's replica stacks [R, ...] (async, `plan.pending`);
    backward: Agg, whose sums land in the owned parameters' `.grad` at the end of backward."""

    @staticmethod
    def forward(ctx, plan: ReplicaPlan, group: Group, *owned):
        me, first = plan.ep_rank, plan.first_expert
        stacks = [p.new_empty((len(plan.expert_ids),) + tuple(p.shape[1:])) for p in owned]
        position = {e: r for r, e in enumerate(plan.expert_ids)}
        pending, sends, recvs = [], [], []
        for e, i, owner, peers, everywhere in _operations(plan, group.size, len(owned)):
            weight = owned[i].detach()[e - first] if owner == me else stacks[i][position[e]]
            if everywhere:  # FasterMoE's shadow: broadcast from the owner
                pending.append(C.broadcast_async(weight, owner, group, kind=TRANS_KIND))
            elif owner == me:
                sends += [(q, weight) for q in peers]
            else:
                recvs.append((owner, weight))
        pending.append(C.p2p_exchange(sends, recvs, group, kind=TRANS_KIND))
        plan.pending = pending
        ctx.plan, ctx.group, ctx.owned = plan, group, owned
        return tuple(stacks)

    @staticmethod
    def backward(ctx, *grads):
        plan, group, owned = ctx.plan, ctx.group, ctx.owned
        me, first = plan.ep_rank, plan.first_expert
        position = {e: r for r, e in enumerate(plan.expert_ids)}
        sums: List[Tuple[int, int, torch.Tensor]] = []  # (expert, parameter index, buffer) at the owner
        pending, sends, recvs = [], [], []
        for e, i, owner, peers, everywhere in _operations(plan, group.size, len(owned)):
            if owner == me:
                buffers = [owned[i].new_zeros(owned[i].shape[1:]) for _ in (peers[:1] if everywhere else peers)]
                sums += [(e, i, b) for b in buffers]
            else:
                grad = grads[i][position[e]].contiguous() if grads[i] is not None else \
                    owned[i].new_zeros(owned[i].shape[1:])
            if everywhere:  # the broadcast's adjoint: reduce to the owner (its own part: zeros)
                pending.append(C.reduce_async(buffers[0] if owner == me else grad, owner, group, kind=AGG_KIND))
            elif owner == me:
                recvs += list(zip(peers, buffers))
            else:
                sends.append((owner, grad))
        pending.append(C.p2p_exchange(sends, recvs, group, kind=AGG_KIND))

        def finish():  # end of the backward pass: the owners' gradients get the replicas' sums
            for handle in pending:
                handle.wait()
            with torch.no_grad():
                for e, i, summed in sums:
                    param = owned[i]
                    if param.grad is None:
                        param.grad = torch.zeros_like(param)
                    param.grad[e - first] += summed

        torch.autograd.Variable._execution_engine.queue_callback(finish)
        return (None, None) + (None,) * len(owned)


@dataclass
class ReplicaWeights:
    """The replica stacks of one forward (`Experts.forward`'s `replicas`)."""

    expert_ids: List[int]
    _stacks: Tuple[torch.Tensor, ...]
    _pending: List[C.Pending] = field(default_factory=list, repr=False)  # Trans in flight

    def stacks(self) -> Tuple[torch.Tensor, ...]:
        """Waits for Trans; per parameter [R, ...] in `Experts.stacks()` order."""
        for handle in self._pending:
            handle.wait()
        return self._stacks

    def with_stacks(self, stacks) -> "ReplicaWeights":
        """The same experts computed with other tensors (the smart schedule's per-step leaves)."""
        return ReplicaWeights(self.expert_ids, tuple(stacks))


def fetch_replicas(experts, placement: Placement, state: ParallelState) -> Optional[ReplicaWeights]:
    """Start Trans for `placement` (collective over `ep` when it has replicas; None otherwise)."""
    if placement.num_replicas == 0:
        return None
    plan = ReplicaPlan.of(placement, state.ep.rank, experts.num_local)
    stacks = _Trans.apply(plan, state.ep, *experts.stacks())
    return ReplicaWeights(plan.expert_ids, stacks, plan.pending)
