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
  the rest of backward. Trans's autograd node is created where the replicas are used
  (`ReplicaWeights.stacks`), not where Trans was issued, so Agg starts right after the replicas'
  expert backward (autograd runs the latest-created ready node first; a node created at issue
  time ran after the dispatch's backward, or after the whole block before when Pro-Prophet's
  scheduler issued Trans there: Agg's exposed time in `benchmarks/moe_layer.py` fell from 7.2 to
  1.3 ms with fastermoe and from 2.9 to 0.8 ms with proprophet when this moved). Only the owner holds optimizer state and is checkpointed; replicas live
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
from megatron_moe.model.precision import grad_buffer, grad_dtype
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
    sink: Optional[C.TimeSink] = field(default=None, repr=False)  # the layer's Trans / Agg times

    @classmethod
    def of(cls, replicas: Tuple[Tuple[int, ...], ...], ep_rank: int, num_local: int,
           sink: Optional[C.TimeSink] = None) -> "ReplicaPlan":
        """`replicas`: `Placement.replicas` (or the part of them one sub-transfer moves)."""
        mine = [e for e, ranks in enumerate(replicas) if ep_rank in ranks[1:]]
        return cls(ep_rank, ep_rank * num_local, tuple(replicas), mine, sink=sink)

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


def _issue_trans(plan: ReplicaPlan, group: Group, owned: Tuple[torch.Tensor, ...]) -> Tuple[Tuple[torch.Tensor, ...], List[C.Pending]]:
    """Trans, asynchronously: owned stacks -> (this rank's replica stacks [R, ...], being filled;
    the handles to wait on)."""
    me, first = plan.ep_rank, plan.first_expert
    stacks = [p.new_empty((len(plan.expert_ids),) + tuple(p.shape[1:])) for p in owned]
    position = {e: r for r, e in enumerate(plan.expert_ids)}
    pending, sends, recvs = [], [], []
    for e, i, owner, peers, everywhere in _operations(plan, group.size, len(owned)):
        weight = owned[i].detach()[e - first] if owner == me else stacks[i][position[e]]
        if everywhere:  # FasterMoE's shadow: broadcast from the owner
            pending.append(C.broadcast_async(weight, owner, group, kind=TRANS_KIND, sink=plan.sink))
        elif owner == me:
            sends += [(q, weight) for q in peers]
        else:
            recvs.append((owner, weight))
    pending.append(C.p2p_exchange(sends, recvs, group, kind=TRANS_KIND, sink=plan.sink))
    return tuple(stacks), pending


class _Trans(torch.autograd.Function):
    """forward: the replica stacks a finished Trans received, as outputs of the owned stacks;
    backward: Agg, whose sums land in the owned parameters' `.grad` at the end of backward.

    The node is created where the replicas are used (`ReplicaWeights.stacks`), not where Trans was
    issued: autograd runs ready nodes latest-created first, so Agg then starts as soon as the
    replicas' gradients exist even when Trans was issued a layer earlier (`techniques/proprophet/cross_layer.py`)."""

    @staticmethod
    def forward(ctx, plan: ReplicaPlan, group: Group, received: Tuple[torch.Tensor, ...], *owned):
        ctx.plan, ctx.group, ctx.owned = plan, group, owned
        return tuple(t.view_as(t) for t in received)

    @staticmethod
    def backward(ctx, *grads):
        plan, group, owned = ctx.plan, ctx.group, ctx.owned
        me, first = plan.ep_rank, plan.first_expert
        position = {e: r for r, e in enumerate(plan.expert_ids)}
        sums: List[Tuple[int, int, torch.Tensor]] = []  # (expert, parameter index, buffer) at the owner
        pending, sends, recvs = [], [], []
        for e, i, owner, peers, everywhere in _operations(plan, group.size, len(owned)):
            if owner == me:
                buffers = [owned[i].new_zeros(owned[i].shape[1:], dtype=grad_dtype(owned[i]))  # fp32 in bf16 runs
                           for _ in (peers[:1] if everywhere else peers)]
                sums += [(e, i, b) for b in buffers]
            else:
                grad = grads[i][position[e]].to(grad_dtype(owned[i])).contiguous() if grads[i] is not None else \
                    owned[i].new_zeros(owned[i].shape[1:], dtype=grad_dtype(owned[i]))
            if everywhere:  # the broadcast's adjoint: reduce to the owner (its own part: zeros)
                pending.append(C.reduce_async(buffers[0] if owner == me else grad, owner, group, kind=AGG_KIND,
                                              sink=plan.sink))
            elif owner == me:
                recvs += list(zip(peers, buffers))
            else:
                sends.append((owner, grad))
        pending.append(C.p2p_exchange(sends, recvs, group, kind=AGG_KIND, sink=plan.sink))

        def finish():  # end of the backward pass: the owners' gradients get the replicas' sums
            for handle in pending:
                handle.wait()
            with torch.no_grad():
                for e, i, summed in sums:
                    grad_buffer(owned[i])[e - first] += summed  # fp32 main_grad in bf16 runs

        torch.autograd.Variable._execution_engine.queue_callback(finish)
        return (None, None, None) + (None,) * len(owned)


@dataclass
class TransPart:
    """One Trans in flight: what it moves (`plan`) from `owned`, into `received`."""

    plan: ReplicaPlan
    group: Group
    owned: Tuple[torch.Tensor, ...]
    received: Tuple[torch.Tensor, ...]
    pending: List[C.Pending]


@dataclass
class ReplicaWeights:
    """The replica stacks of one forward (`Experts.forward`'s `replicas`): one part per *Trans*
    that moved them (two when Pro-Prophet's scheduler splits it, `techniques/proprophet/cross_layer.py`); parts
    hold ascending, disjoint expert ranges, so their concatenation is ascending too."""

    expert_ids: List[int]
    _parts: List[TransPart]
    _stacks: Optional[Tuple[torch.Tensor, ...]] = field(default=None, repr=False)

    def stacks(self) -> Tuple[torch.Tensor, ...]:
        """Waits for Trans; per parameter [R, ...] in `Experts.stacks()` order (the same tensors on
        every call)."""
        if self._stacks is None:
            outputs = []
            for part in self._parts:
                for handle in part.pending:
                    handle.wait()
                outputs.append(_Trans.apply(part.plan, part.group, part.received, *part.owned))
            self._stacks = outputs[0] if len(outputs) == 1 else tuple(torch.cat(p) for p in zip(*outputs))
        return self._stacks

    def with_stacks(self, stacks) -> "ReplicaWeights":
        """The same experts computed with other tensors (the smart schedule's per-step leaves)."""
        return ReplicaWeights(self.expert_ids, [], tuple(stacks))

    @staticmethod
    def joined(parts: List[Optional["ReplicaWeights"]]) -> Optional["ReplicaWeights"]:
        """One ReplicaWeights of sub-transfers' parts (None: nothing replicated)."""
        parts = [p for p in parts if p is not None]
        if not parts:
            return None
        return ReplicaWeights([e for p in parts for e in p.expert_ids], [t for p in parts for t in p._parts])


def start_trans(experts, replicas: Tuple[Tuple[int, ...], ...], state: ParallelState,
                sink: Optional[C.TimeSink] = None) -> Optional[ReplicaWeights]:
    """Issue *Trans* for `replicas` (as in `Placement.replicas`; None if nothing is replicated)."""
    if all(len(ranks) == 1 for ranks in replicas):
        return None
    plan = ReplicaPlan.of(replicas, state.ep.rank, experts.num_local, sink)
    owned = tuple(experts.stacks())
    with torch.no_grad():
        received, pending = _issue_trans(plan, state.ep, owned)
    return ReplicaWeights(plan.expert_ids, [TransPart(plan, state.ep, owned, received, pending)])


def fetch_replicas(experts, placement: Placement, state: ParallelState,
                   sink: Optional[C.TimeSink] = None) -> Optional[ReplicaWeights]:
    """Start Trans for `placement` (collective over `ep` when it has replicas; None otherwise).
    Ranks that hold an expert themselves (vExpert slots) need no Trans for it."""
    transient = placement.transient_replicas()
    if experts.slot_table is not None and any(len(ranks) > 1 for ranks in transient):
        raise ValueError("per-iteration replicas (Trans) of a layer with vExpert slots are not supported: "
                         f"{transient}")
    return start_trans(experts, transient, state, sink)
