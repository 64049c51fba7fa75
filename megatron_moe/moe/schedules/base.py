"""Schedule interface: how one MoE layer's tokens travel between ranks (DESIGN.md §4).

`MoELayer` drives every schedule the same way::

    routed = schedule.route(router, x)             # gate + the communication that yields counts [S, E]
    placement = schedule.place(routed, balancer)   # balancer.plan(counts, sources) -> Placement
    y = schedule.run(routed, placement, experts, replicas, hooks)   # dispatch -> experts -> combine

`replicas` are the placement's replica weights, their *Trans* already issued (`moe/replicas.py`);
`hooks` (`RunHooks`) let a cross-layer scheduler run work while the dispatch all-to-all is in
flight and right before the experts compute (`techniques/proprophet/cross_layer.py`, Pro-Prophet Alg. 2).

A schedule owns everything between the replicated hidden states `x` [n, h] and the replicated
output `y` [n, h]: which tokens each rank routes, the collectives that move them, how partial
sums are combined, and `expert_grad_scale`, the factor that cancels redundant expert compute in
the weight gradients (see `moe/layer.py` for the gradient contract). It builds all all-to-all
splits and permutations from the Placement, never from the policy that produced it.

Seams for the techniques to come:

* Parm S1 (§III-B) overrides `route`: MP-Split before the gate, per-expert counts exchanged over
  `tp` so the aux loss and capacity positions (`router.capacity_keep(prior_counts=...)`) cover the
  whole micro-batch. S2 routes the replicated input like the baseline and splits each expert's
  tokens over `tp` in `dispatch`. Both dispatch/combine with EP&ESP-AlltoAll over `ep_esp`
  (sources = `ep_esp` ranks) and compute no token twice (`expert_grad_scale` 1). SAA is S2's combine.
* FasterMoE's smart schedule (`moe.smart_schedule`, techniques/fastermoe/smart.py) replaces the all-to-all,
  experts and all-to-all back of `run` with pipelined pairwise steps; a schedule supports it by
  providing `smart_parts` (the rows as they leave, ordered by peer) and `smart_finish`.
  Lancet's partitioned forward (techniques/lancet/lancet_partition.py) runs other parts' non-MoE computation in
  `hooks.while_dispatching` / `while_combining`; its dW deferral fills the backward all-to-alls.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from megatron_moe.config.schema import Config
from megatron_moe.perf import host_sync
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.moe.experts import ExpertBatch, Experts
from megatron_moe.moe.placement import Placement
from megatron_moe.moe.router import Router, Routing
from megatron_moe.moe.stats import MoEStats
from megatron_moe.config.registry import Registry

# moe.smart_schedule's pairwise exchange, "smart" (techniques/fastermoe/smart.py `Smart`: Plan,
# peer_group, exchange): a schedule builds its parts, the exchange itself lives with FasterMoE
EXCHANGES: Registry = Registry("moe.smart_schedule")


@dataclass
class Routed:
    """What `route` returns; schedules subclass it to carry their own state to `dispatch`."""

    # the router's decisions; tokens_per_expert, dropped and aux_loss cover this rank's whole
    # data-parallel micro-batch
    routing: Routing
    # Long[S, E] on the host: kept assignments per source and expert (balancer.plan's input); the
    # forward's one host read of device data (`perf/host_sync.py`), everything the host plans comes from it
    counts: torch.Tensor


@dataclass
class RunHooks:
    """Callbacks on one forward of a schedule (each optional, each runs once, in every case: what
    no all-to-all takes runs when `run` returns, see `flush`)."""

    while_dispatching: Optional[Callable[[], None]] = None  # while the dispatch all-to-all is in flight
    before_experts: Optional[Callable[[], None]] = None  # right before the expert computation
    while_combining: Optional[Callable[[], None]] = None  # while the combine all-to-all is in flight
    experts_output: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # applied to the experts' output

    def in_flight(self) -> Optional[Callable[[], None]]:
        """`while_dispatching` for a schedule's first all-to-all to run (once)."""
        fn, self.while_dispatching = self.while_dispatching, None
        return fn

    def combining(self) -> Optional[Callable[[], None]]:
        """`while_combining` for the combine all-to-all (once)."""
        fn, self.while_combining = self.while_combining, None
        return fn

    def flush(self) -> None:
        """Run what no dispatch all-to-all took (a schedule without one, a group of one)."""
        fn = self.in_flight()
        if fn is not None:
            fn()

    def flush_combining(self) -> None:
        fn = self.combining()
        if fn is not None:
            fn()


def gate_weighted_sum(rows: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, n: int) -> torch.Tensor:
    """The gate-weighted combine: rows [m, h] aligned with `slots` (Long[m], token * k + choice)
    and combine weights [n, k] -> [n, h], token t's row sum_c weights[t, c] * row of slot t * k + c
    (fp32 when the weights are: bf16 rows are summed in fp32)."""
    k = weights.shape[1]
    weighted = rows * weights.flatten().index_select(0, slots).unsqueeze(1)
    return weighted.new_zeros((n, rows.shape[1])).index_add_(0, slots // k, weighted)  # in place: no copy of the zeros


class Schedule(ABC):
    expert_grad_scale: float = 1.0  # multiplies expert weight gradients
    hooks: RunHooks = RunHooks()  # this forward's (set by `run`)
    wgrad = None  # Lancet's WGradScheduler (techniques/lancet/lancet.py): its `fill` runs during backward all-to-alls
    # the gate-weighted combine (`gate_weighted_sum`); training.compile puts a compiled one here (model/compile.py)
    weighted_sum: Callable[..., torch.Tensor] = staticmethod(gate_weighted_sum)

    def backward_fill(self):
        """What runs while a backward all-to-all is in flight (`fill(elements)`), or None."""
        return self.wgrad.fill if self.wgrad is not None else None

    def __init__(self, cfg: Config, state: ParallelState):
        self.cfg, self.state = cfg, state

    @abstractmethod
    def route(self, router: Router, x: torch.Tensor) -> Routed:
        """x [n, h]: this rank's (TP-replicated) tokens."""

    @abstractmethod
    def dispatch(self, routed: Routed, placement: Placement) -> Tuple[ExpertBatch, Any]:
        """Move tokens to the ranks that compute them: (this rank's expert batch, context for combine)."""

    @abstractmethod
    def combine(self, expert_output: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Expert outputs [m, h] (this ESP shard's partial sums) -> y [n, h] for this rank's tokens."""

    @abstractmethod
    def source_ep_ranks(self) -> List[int]:
        """The EP rank of each of this schedule's sources (rows of `Routed.counts`)."""

    def place(self, routed: Routed, balancer) -> Placement:
        """The balancer's Placement for `routed`'s counts (Parm `auto` also picks S1/S2 here)."""
        return balancer.plan(routed.counts, self.source_ep_ranks())

    def stats(self, routed: Routed, placement: Placement) -> MoEStats:
        """This forward's statistics (`MoELayer.last_stats`)."""
        routing = routed.routing
        return MoEStats(routing.tokens_per_expert, routing.dropped, placement.tokens_per_ep_rank(), self.cfg.moe.schedule,
                        placement.num_replicas)

    def run(self, routed: Routed, placement: Placement, experts: Experts, replicas=None,
            hooks: Optional[RunHooks] = None) -> torch.Tensor:
        """`replicas`: `moe/replicas.py`'s weights for `placement` (None without replicas)."""
        self.hooks = hooks or RunHooks()
        if self.cfg.moe.smart_schedule:
            self.hooks.flush()
            if self.hooks.before_experts:
                self.hooks.before_experts()
            y = self._experts_output(self.run_smart(routed, placement, experts, replicas))  # (its steps interleave)
        else:
            batch, ctx = self.dispatch(routed, placement)  # its first all-to-all takes `hooks.in_flight()`
            self.hooks.flush()
            if self.hooks.before_experts:
                self.hooks.before_experts()
            out = self._experts_output(experts(batch, replicas, grad_scale=self.expert_grad_scale))
            y = self.combine(out, ctx)  # takes `combining()`
        self.hooks.flush_combining()
        return y

    def _experts_output(self, out: torch.Tensor) -> torch.Tensor:
        return self.hooks.experts_output(out) if self.hooks.experts_output else out

    # -- FasterMoE's smart schedule (techniques/fastermoe/smart.py) --------------------------------------------
    def smart_parts(self, routed: Routed, placement: Placement) -> Tuple[torch.Tensor, Any, Any, Callable]:
        """(rows to send [m, h] ordered by destination peer, context for `smart_finish`, SmartPlan,
        what follows the experts on the receiving rank before the rows go back)."""
        raise NotImplementedError(f"{type(self).__name__} does not support moe.smart_schedule")

    def smart_finish(self, returned: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Rows returned by their destinations, aligned with the sent rows -> y [n, h]."""
        raise NotImplementedError

    def run_smart(self, routed: Routed, placement: Placement, experts: Experts, replicas) -> torch.Tensor:
        smart = EXCHANGES.get("smart")
        send, ctx, plan, after_experts = self.smart_parts(routed, placement)

        def compute(batch: ExpertBatch, replica_stacks) -> torch.Tensor:
            held = replicas.with_stacks(replica_stacks) if replicas is not None else None
            return after_experts(experts(batch, held, grad_scale=self.expert_grad_scale))

        return self.smart_finish(smart.exchange(send, plan, compute, replicas), ctx)


def even_split(n: int, parts: int) -> List[int]:
    """`n` rows in `parts` contiguous sizes that differ by at most one (earlier parts larger)."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def slots_by_expert(ids: torch.Tensor, kept: int) -> torch.Tensor:
    """ids Long[n, k] (or flat) with -1 for dropped choices, `kept` (host int) how many are not
    -1 -> Long[m = kept]: the kept slots (token * k + choice) ordered by expert, token order
    within an expert (stable). A stable sort with the dropped ones last, cut at `kept` (known
    from the counts the host read anyway): no `nonzero`, which reads its length on the host."""
    ids = ids.flatten()
    key = ids.masked_fill(ids < 0, torch.iinfo(ids.dtype).max)  # dropped choices sort last
    return torch.argsort(key, stable=True)[:kept]


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """Long[m] permutation -> its inverse (`x.index_select(0, perm).index_select(0, inverse) == x`)."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def unless_identity(perm: torch.Tensor) -> Optional[torch.Tensor]:
    """Long[m] permutation on the host (placement built it) -> itself, or None where it is the
    identity (a gather of m rows forward and a scatter-add of their gradient backward saved; the
    caller sends the others down with `upload`). Rows ordered by expert are already ordered by
    destination where each EP rank holds a contiguous range of experts (the default placement),
    and a single EP rank's orders all keep rows in place."""
    return None if torch.equal(perm, torch.arange(perm.numel())) else perm


def upload(tensors: Sequence[Optional[torch.Tensor]], device: torch.device) -> List[Optional[torch.Tensor]]:
    """Host integer tensors (permutations, counts; None entries stay None) -> `device`, all in
    one pinned buffer and one non-blocking copy (`perf/host_sync.py`)."""
    present = [t for t in tensors if t is not None]
    sent = iter(host_sync.to_device(present, device, "orders")) if present else iter(())
    return [next(sent) if t is not None else None for t in tensors]


def permute_rows(rows: torch.Tensor, perm: Optional[torch.Tensor], inverse: bool = False) -> torch.Tensor:
    """rows [m, h] -> rows.index_select(0, perm) (or by perm's inverse); `rows` where perm is None
    (the identity, `unless_identity`)."""
    if perm is None:
        return rows
    return rows.index_select(0, inverse_permutation(perm) if inverse else perm)
