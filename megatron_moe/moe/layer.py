"""MoELayer: route -> place (balancer.plan) -> dispatch -> experts -> combine (DESIGN.md §4).

`forward(x [b, s, h]) -> (y [b, s, h], aux_loss)`; x and y are replicated across the TP group.
`aux_loss` is the coefficient-weighted load-balancing + z loss of this rank's data-parallel
micro-batch (identical on its TP ranks). The schedule (`moe.schedule`) and the balancer
(`moe.balancer`) come from their registries; `last_stats` describes the latest forward.

Gradient contract (what the trainer must do, and what every schedule guarantees):

* Every rank back-propagates (its micro-batch loss) / num_micro_batches, where its micro-batch
  loss includes this layer's `aux_loss`.
* Then the trainer all-reduces SUMs and divides by dp_size: dense params (the router weight) over
  `dp`, expert params (w1, w2, b1, b2) over `edp`.
* Result: every gradient equals the single-process reference gradient of the mean loss over all
  data-parallel micro-batches (and num_micro_batches accumulation steps), for each shard.

Why it holds. The router weight is replicated across TP; each TP rank routes, combines and
back-propagates its own copy of the micro-batch, so it holds the full gradient of its micro-batch
loss (identical across TP; averaging over `tp` keeps it so). An expert shard's gradient sums the
contributions of every token row it computed. Over all `edp` replicas, each data-parallel
micro-batch's tokens are computed once per TP rank (the baseline's redundancy), so the schedule
multiplies expert weight gradients by `expert_grad_scale` = 1/N_MP inside the layer (identity
forward); schedules without redundant compute (Parm S1/S2) use 1. After SUM over `edp` / dp_size
this is the mean over micro-batches. Input gradients dx are complete on every TP rank.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Deque, Optional, Tuple

import torch

from megatron_moe.config.schema import Config
from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.recompute import is_recomputing
from megatron_moe.model.transformer import FFN_LAYERS
from megatron_moe.moe.balancers import BALANCERS
from megatron_moe.moe.experts import Experts
from megatron_moe.moe.replicas import fetch_replicas
from megatron_moe.moe.router import GATES
from megatron_moe.moe.schedules import SCHEDULES
from megatron_moe.moe.schedules.base import RunHooks
from megatron_moe.moe.shared_expert import SharedExpert
from megatron_moe.moe.stats import MoEStats


@FFN_LAYERS.register("moe")
class MoELayer(torch.nn.Module):
    def __init__(self, cfg: Config, state: ParallelState, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.router = GATES.get(cfg.moe.gate)(cfg, state)
        self.balancer = BALANCERS.get(cfg.moe.balancer)(cfg, state)
        self.experts = Experts(cfg, state, self.balancer.slots_per_rank)  # vExpert slots (FlexMoE, EPLB) or owners
        self.balancer.attach(self.experts)
        self.schedule = SCHEDULES.get(cfg.moe.schedule)(cfg, state)
        # moe.shared_expert_ffn_hidden_size: dense shared experts, run during the dispatch all-to-all
        self.shared_expert = SharedExpert(cfg, state) if cfg.moe.shared_expert_ffn_hidden_size else None
        self.state = state
        self.last_stats: Optional[MoEStats] = None
        # cross-layer scheduling (the balancer's `cross_layer`; Pro-Prophet's: techniques/proprophet/cross_layer.py):
        # the next MoE layer, Trans it got early
        self.next_moe: Optional["MoELayer"] = None
        self.prefetched, self.prefetched_rest = None, None
        self.replica_times = C.TimeSink()  # this forward's Trans / Agg times
        # Lancet's partitioned forward (techniques/lancet/lancet_partition.py): set while it runs one of a
        # micro-batch's batch parts through this layer, a later part (index > 0) keeps the times
        self.part_index: Optional[int] = None
        # training.recompute=full: each training forward's placements, replayed by its recomputation
        # in backward (first in, first out: pipeline schedules run several forwards before their backwards)
        self.keeps_plans = cfg.training.recompute == "full"
        self.planned: Deque[list] = deque()

    def forward(self, x: torch.Tensor, while_dispatching: Optional[Callable[[], None]] = None,
                while_combining: Optional[Callable[[], None]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """`while_dispatching` / `while_combining`: work to run while this forward's dispatch /
        combine all-to-all is in flight (Lancet's partitioned forward; run at once without one)."""
        b, s, h = x.shape
        if not is_recomputing():  # Pro-Prophet: SubAgg1 of this layer's Agg goes out when x's gradient is complete
            x = self.balancer.cross_layer.layer_input(self, x)
        routed = self.schedule.route(self.router, x.reshape(b * s, h))
        if is_recomputing():  # training.recompute=full: the original forward again, nothing learned
            return self._recompute(routed, x.reshape(b * s, h), b, s, h, x.dtype)
        self.balancer.complete_moves()  # best-effort vExpert moves land here, after the layers before this one ran
        planner = _PlanRecorder(self.balancer)
        placement = self.schedule.place(routed, planner)
        if self.keeps_plans and torch.is_grad_enabled():
            self.planned.append(planner.placements)
        if self.prefetched is None and not self.part_index:
            self.replica_times = C.TimeSink()
        replicas = self.balancer.cross_layer.take_prefetched(self, placement.replicas)  # issued by the block before
        if replicas is None:
            replicas = fetch_replicas(self.experts, placement, self.state, self.replica_times)  # Trans starts
        self.balancer.last_plan_seconds = 0.0
        observe = None
        if torch.is_grad_enabled():  # training forwards teach the balancer (evaluation does not)
            counts, sources = placement.routing_table.sum(2), self.schedule.source_ep_ranks()
            observe = lambda: self.balancer.observe(counts, sources)  # noqa: E731
            if not self.balancer.plans_during_dispatch:
                observe()
                observe = None
        cross_layer = self.balancer.cross_layer
        shared, run_shared = self._shared(x.reshape(b * s, h))
        hooks = RunHooks(_both(_both(observe, while_dispatching), run_shared),
                         lambda: cross_layer.before_experts(self, placement.tokens_per_ep_rank()), while_combining,
                         lambda out: cross_layer.experts_output(self, out))
        y = shared(self.schedule.run(routed, placement, self.experts, replicas, hooks))  # [b*s, h]
        cross_layer.after_layer(self)
        stats = self.schedule.stats(routed, placement)
        stats.plan_seconds, stats.replica_times = self.balancer.last_plan_seconds, self.replica_times
        if self.experts.slot_table is not None:  # vExperts beyond one per expert (co-located ones too)
            stats.replicas = self.experts.slot_table.extra_vexperts
        self.last_stats = stats
        if torch.is_grad_enabled() and self.router.expert_bias is not None:  # the step's loads (moe/expert_bias.py)
            self.router.loads.add(stats.tokens_per_expert)
        return y.to(x.dtype).view(b, s, h), routed.routing.aux_loss

    def _shared(self, x: torch.Tensor) -> Tuple[Callable[[torch.Tensor], torch.Tensor], Optional[Callable[[], None]]]:
        """(add the shared experts' output of x `[n, h]` to the routed output `[n, h]`, the callback
        computing it: a RunHooks one, so that it runs while the dispatch all-to-all is in flight)."""
        if self.shared_expert is None:
            return (lambda y: y), None
        out, grad_enabled = [], torch.is_grad_enabled()

        def run() -> None:  # all-to-alls call it inside their autograd Function's forward (autograd off)
            with torch.set_grad_enabled(grad_enabled):
                out.append(self.shared_expert(x))
        return (lambda y: y + out[0]), run

    def _recompute(self, routed, x, b: int, s: int, h: int, dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """This layer's forward run again in backward (model/recompute.py): the placements the
        original forward planned (the balancer may have moved on), no observe, no prefetch, no stats."""
        placement = self.schedule.place(routed, _PlanReplay(self.planned.popleft()))
        replicas = fetch_replicas(self.experts, placement, self.state, C.TimeSink())
        shared, run_shared = self._shared(x)
        y = shared(self.schedule.run(routed, placement, self.experts, replicas, RunHooks(run_shared)))
        return y.to(dtype).view(b, s, h), routed.routing.aux_loss


def _both(first: Optional[Callable[[], None]], second: Optional[Callable[[], None]]) -> Optional[Callable[[], None]]:
    """One callback running `first` then `second` (either may be None)."""
    if first is None or second is None:
        return first or second
    return lambda: (first(), second())


class _PlanRecorder:
    """The balancer, as `Schedule.place` sees it, keeping the placements its `plan` returns."""

    def __init__(self, balancer):
        self.balancer, self.placements = balancer, []

    def plan(self, counts, sources):
        self.placements.append(self.balancer.plan(counts, sources))
        return self.placements[-1]


class _PlanReplay:
    """A recomputed forward's planner: the original forward's placements, in the order planned."""

    def __init__(self, placements):
        self.placements = list(placements)

    def plan(self, counts, sources):
        return self.placements.pop(0)
