"""Per-iteration expert replicas: *Trans* and *Agg* (FasterMoE §4.1 shadowing, Pro-Prophet §IV
lightweight placements), shared by every balancer whose Placement adds replicas.

When a Placement lists EP rank q as a replica of expert e (owner p = `owner_of(e)`), q computes
e's rows with p's *current* weights:

* **Trans** (forward): ESP shard rank j of p sends its shard of every parameter of e
  (`Experts.stacks()`: w1, w2 and the biases) to shard rank j of q (counted as "trans"): a
  broadcast when e is replicated on every EP rank (FasterMoE's shadows), point to point
  otherwise. It is issued asynchronously before the token all-to-all (`Schedule.run`; a layer
  earlier with Pro-Prophet's scheduler, `techniques/proprophet/cross_layer.py`) and waited on when
  the experts run.
* **Agg** (Trans's backward): the replicas' gradients are summed into p's (a reduce for a
  broadcast expert, point to point otherwise; "agg"), asynchronously; p adds the sums into its
  parameters' `.grad` when the backward pass ends (autograd's `queue_callback`, after every other
  end-of-backward callback: Lancet's dW drain adds p's own weight gradients first, so the order of
  the additions never depends on timing). Trans's autograd node is created where the replicas are
  used (`ReplicaWeights.stacks`), not where Trans was issued, so Agg starts right after the
  replicas' expert backward (autograd runs the latest-created ready node first; a node created at
  issue time ran after the dispatch's backward, or after the whole block before when Pro-Prophet's
  scheduler issued Trans there: Agg's exposed time in `benchmarks/moe_layer.py` fell from 7.2 to
  1.3 ms with fastermoe and from 2.9 to 0.8 ms with proprophet when this moved). With
  Pro-Prophet's block-wise scheduler Trans's backward hands the operations to a `SplitAgg`
  instead, which the block before issues in two parts, SubAgg1 and SubAgg2 (Alg. 2 lines 5, 12,
  14). Only the owner holds optimizer state and is checkpointed; replicas live for one forward.

Communicator: every Trans and Agg (whole or split, prefetched or not, FasterMoE's and
Pro-Prophet's) runs on `ep`'s side channel (`Group.side_channel()`, a process group of its own
over `ep`'s ranks that both balancers ask `SIDE_CHANNELS` for), never on `ep`. On NCCL each
communicator's operations run one after another on its own stream: on `ep` itself Trans would
hold the dispatch all-to-all back until it finished, and Agg the backward all-to-alls of the
layers before. On the side channel's stream Trans runs while the dispatch all-to-all (on `ep`'s
stream) and the computation before the experts run; its wait makes only the compute stream wait
(no host sync). Agg runs while the rest of backward computes and the earlier layers' backward
all-to-alls run on `ep`, and is waited on at the end of backward. The streams share the links
and SMs, so overlapped transfers hide latency but split bandwidth. Every rank issues the
operations of both communicators in the same program order, as NCCL requires of concurrent
communicators. The side channel is `ep`'s only: FlexMoE's moves use one too but never with these
balancers, and the overlapped gradient buckets have `dp`'s and `edp`'s
(`optimizer.overlap_grad_reduce`), communicators of their own even where they and `ep` hold the same ranks. On gloo the side channel
has its own connections and worker thread, with the same effect. A ParallelState built without
it (tests, tools that skip `SIDE_CHANNELS`) runs Trans / Agg on `ep` and counts them there.

Every rank that owns or holds a replica takes part in both. A rank computes its replica rows
even when it has none, so that Trans's backward runs everywhere and Agg is matched on both sides
(`Experts.forward`). Every rank issues the operations in the same order: broadcast experts
ascending, each parameter in `stacks()` order, then one batch of point-to-point messages (per
expert ascending, per replica rank ascending, per parameter), which pairs of ranks match in
posting order.

Bytes (collectives.py's convention), under group `ep_side` ("trans/ep_side", "agg/ep_side"; 0 on
"trans/ep", "agg/ep"): Trans counts shard_params(e) x the weights' element size (4 in fp32) at the
owner for every (replicated expert, receiver); Agg shard_params(e) x 4 (fp32 main gradients) at
every replica (`tests/distributed/test_replicas.py` checks the formula and the groups),
SubAgg1 / SubAgg2 also under their tags (`tests/distributed/test_overlap_order.py`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch

from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.parallel_state import Group, ParallelState
from megatron_moe.model.precision import grad_buffer, grad_dtype
from megatron_moe.moe.placement import Placement

TRANS_KIND = "trans"
AGG_KIND = "agg"
SUB_AGG_TAGS = ("SubAgg1", "SubAgg2")  # `COMM_STATS.tagged`: the parts of "agg" (Pro-Prophet Alg. 2, `SplitAgg`)


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


AggItem = Tuple[int, str, int, torch.Tensor]  # (expert, "reduce" | "send" | "recv", peer: group rank, tensor)


Sum = Tuple[int, int, torch.Tensor]  # (expert, parameter index, buffer) at the owner


def _agg_items(plan: ReplicaPlan, group: Group, owned, grads) -> Tuple[List[AggItem], List[Sum]]:
    """Agg of one Trans part: (its operations in the order every rank issues them, the owner's
    (expert, parameter index, buffer) sums). A broadcast expert's adjoint is a reduce to the owner
    (whose own part is zeros); the others are point to point."""
    me = plan.ep_rank
    position = {e: r for r, e in enumerate(plan.expert_ids)}
    items: List[AggItem] = []
    sums: List[Sum] = []
    for e, i, owner, peers, everywhere in _operations(plan, group.size, len(owned)):
        if owner == me:
            buffers = [owned[i].new_zeros(owned[i].shape[1:], dtype=grad_dtype(owned[i]))  # fp32 in bf16 runs
                       for _ in (peers[:1] if everywhere else peers)]
            sums += [(e, i, b) for b in buffers]
            items += ([(e, "reduce", owner, buffers[0])] if everywhere
                      else [(e, "recv", q, b) for q, b in zip(peers, buffers)])
        else:
            grad = grads[i][position[e]].to(grad_dtype(owned[i])).contiguous() if grads[i] is not None else \
                owned[i].new_zeros(owned[i].shape[1:], dtype=grad_dtype(owned[i]))
            items.append((e, "reduce" if everywhere else "send", owner, grad))
    return items, sums


def _issue_agg(items: List[AggItem], group: Group, sink: Optional[C.TimeSink]) -> List[C.Pending]:
    """Issue Agg `items`: each reduce in order, then one batch of point-to-point messages."""
    pending = [C.reduce_async(t, peer, group, kind=AGG_KIND, sink=sink) for _, op, peer, t in items if op == "reduce"]
    sends = [(peer, t) for _, op, peer, t in items if op == "send"]
    recvs = [(peer, t) for _, op, peer, t in items if op == "recv"]
    return pending + [C.p2p_exchange(sends, recvs, group, kind=AGG_KIND, sink=sink)]


def _after_backward(fn: Callable[[], None]) -> None:
    """Run `fn` when this backward pass ends, after every callback queued during it (Lancet's dW
    drain among them): the replicas' sums then land in `.grad` after all of the owner's own weight
    gradients, whichever of those timing let Lancet run inside an all-to-all, so the order of the
    float additions, and the result, never depend on timing (`tests/distributed/test_reproducible.py`)."""
    engine = torch.autograd.Variable._execution_engine
    engine.queue_callback(lambda: engine.queue_callback(fn))


def _add_sums(sums, owned, first: int) -> None:
    """The owners' gradients get the replicas' sums (fp32 main_grad in bf16 runs)."""
    with torch.no_grad():
        for e, i, summed in sums:
            grad_buffer(owned[i])[e - first] += summed


class SplitAgg:
    """One forward's Agg of one MoE layer in Pro-Prophet's two parts (Alg. 2 line 5): SubAgg1, the
    experts of `first`, and SubAgg2, the others. The block before issues each at its point of the
    backward pass (`issue(1)`: line 12, `issue(2)`: line 14; techniques/proprophet/cross_layer.py),
    on Trans's group (`ep`'s side channel), counted as "agg" and tagged "SubAgg1" / "SubAgg2"
    (`COMM_STATS.tagged`). Trans's backward only `add`s its operations; those of a part whose point
    has passed go out at once. When backward ends everything left goes out (same order on every
    rank: the points, then each part's items by expert), is waited on and the owners' sums land."""

    def __init__(self, first):
        self.first = frozenset(first)
        self.due: set = set()  # parts whose issue point has passed
        self.waiting: List[AggItem] = []
        self.pending: List[C.Pending] = []
        self.finishes: List[Callable[[], None]] = []
        self.group: Optional[Group] = None
        self.sink: Optional[C.TimeSink] = None

    def add(self, items: List[AggItem], finish: Callable[[], None], group: Group, sink) -> None:
        if not self.finishes:
            _after_backward(self._finish)
        self.waiting += items
        self.finishes.append(finish)
        self.group, self.sink = group, sink
        self._issue()

    def issue(self, part: int) -> None:
        self.due.add(part)
        self._issue()

    def _issue(self) -> None:
        for part, tag in ((1, SUB_AGG_TAGS[0]), (2, SUB_AGG_TAGS[1])):
            batch = [item for item in self.waiting if (item[0] in self.first) == (part == 1)]
            if part not in self.due or not batch:
                continue
            self.waiting = [item for item in self.waiting if (item[0] in self.first) != (part == 1)]
            with C.COMM_STATS.tagging(tag):
                self.pending += _issue_agg(sorted(batch, key=lambda item: item[0]), self.group, self.sink)

    def _finish(self) -> None:
        self.due.update((1, 2))
        self._issue()
        for handle in self.pending:
            handle.wait()
        for finish in self.finishes:
            finish()


class _Trans(torch.autograd.Function):
    """forward: the replica stacks a finished Trans received, as outputs of the owned stacks;
    backward: Agg, whose sums land in the owned parameters' `.grad` at the end of backward; issued
    at once, or with `split` (a `SplitAgg`) handed to it for Pro-Prophet's scheduler to issue.

    The node is created where the replicas are used (`ReplicaWeights.stacks`), not where Trans was
    issued: autograd runs ready nodes latest-created first, so Agg then starts as soon as the
    replicas' gradients exist even when Trans was issued a layer earlier (`techniques/proprophet/cross_layer.py`)."""

    @staticmethod
    def forward(ctx, plan: ReplicaPlan, group: Group, split: Optional[SplitAgg], received: Tuple[torch.Tensor, ...],
                *owned):
        ctx.plan, ctx.group, ctx.split, ctx.owned = plan, group, split, owned
        return tuple(t.view_as(t) for t in received)

    @staticmethod
    def backward(ctx, *grads):
        plan, group, owned = ctx.plan, ctx.group, ctx.owned
        items, sums = _agg_items(plan, group, owned, grads)
        finish = lambda: _add_sums(sums, owned, plan.first_expert)  # noqa: E731
        if ctx.split is not None:
            ctx.split.add(items, finish, group, plan.sink)
        else:
            pending = _issue_agg(items, group, plan.sink)

            def wait_and_add():  # end of the backward pass
                for handle in pending:
                    handle.wait()
                finish()

            _after_backward(wait_and_add)
        return (None, None, None, None) + (None,) * len(owned)


@dataclass
class TransPart:
    """One Trans in flight: what it moves (`plan`) from `owned`, into `received`."""

    plan: ReplicaPlan
    group: Group
    owned: Tuple[torch.Tensor, ...]
    received: Tuple[torch.Tensor, ...]
    pending: List[C.Pending]
    split: Optional[SplitAgg] = None  # its Agg, when Pro-Prophet's scheduler issues it in two parts


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
                outputs.append(_Trans.apply(part.plan, part.group, part.split, part.received, *part.owned))
            self._stacks = outputs[0] if len(outputs) == 1 else tuple(torch.cat(p) for p in zip(*outputs))
        return self._stacks

    def split_agg(self, split: SplitAgg) -> None:
        """Agg of every part goes to `split` instead of out at once (before `stacks`)."""
        for part in self._parts:
            part.split = split

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
    """Issue *Trans* for `replicas` (as in `Placement.replicas`; None if nothing is replicated) on
    `ep`'s side channel (`ep` itself where none was built); its Agg goes on the same."""
    if all(len(ranks) == 1 for ranks in replicas):
        return None
    plan = ReplicaPlan.of(replicas, state.ep.rank, experts.num_local, sink)
    owned, group = tuple(experts.stacks()), state.ep.side_channel()
    with torch.no_grad():
        received, pending = _issue_trans(plan, group, owned)
    return ReplicaWeights(plan.expert_ids, [TransPart(plan, group, owned, received, pending)])


def fetch_replicas(experts, placement: Placement, state: ParallelState,
                   sink: Optional[C.TimeSink] = None) -> Optional[ReplicaWeights]:
    """Start Trans for `placement` (collective over `ep`'s side channel when it has replicas; None otherwise).
    Ranks that hold an expert themselves (vExpert slots) need no Trans for it."""
    transient = placement.transient_replicas()
    if experts.slot_table is not None and any(len(ranks) > 1 for ranks in transient):
        raise ValueError("per-iteration replicas (Trans) of a layer with vExpert slots are not supported: "
                         f"{transient}")
    return start_trans(experts, transient, state, sink)
