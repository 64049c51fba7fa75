"""FlexMoE's vExpert scheduler (Nie et al., SIGMOD'23, §3; `moe.balancer: flexmoe`).

Every EP rank has `moe.flexmoe.slots_per_rank` vExpert slots (default E/ep + 1); the vExperts of
one expert on one rank share one copy of its weights and AdamW state (§3.1, `moe/vexperts.py`). Per layer, on the mean rows per
iteration of the window (every rank decides alike):

    trigger  threshold (default): after every step, Alg. 1 line 3's check of the window's balance
             ratio (Eq. 6) against moe.flexmoe.threshold; interval: every moe.flexmoe.interval
    Alg. 1   while balance ratio (Eq. 6) > moe.flexmoe.threshold:        lines 2-8
                 plan = the policy maker: `flexmoe_policy.straggler_plan` (default: a local
                        search relative to the slowest GPU, not Alg. 2; at its fixed points
                        `escape_plan`) or Alg. 2 as printed
                        (`flexmoe_plan.make_scheduling_plan`, moe.flexmoe.policy=printed)
             Migrate while Eq. 5 plus transfer cost gains                 line 9
    execute the ops as one round of transfers (`vexpert_moves.MovesInFlight`, §4's merged moves):
             moe.flexmoe.moves=sync lands them after the step; best_effort (§4, "Best-Effort
             Adjustment") leaves them in flight until the layer's next forward

The cost model (Eq. 5, 7-9, `flexmoe_plan.FlexCostModel`) comes from the hardware profile: a
token's forward + backward through one expert shard (3 F x `expert_compute.beta`, TPS of
Eq. 7), a token row (h elements) and a parameter element sent point to point (`p2p.beta`, Bw of
Eq. 8-9); a move's transfer (weights + both AdamW moments) is spread over
`moe.flexmoe.amortize_steps` iterations (default 10). Primitives are counted net
(`primitive_counts`). Tokens are routed by Alg. 3
(`vexpert_base.SlotBalancer.plan`). `flexmoe_plan.py` and `flexmoe_policy.py` document where the
planner departs from the paper.
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from megatron_moe.moe.balancers import BALANCERS
from megatron_moe.techniques.flexmoe.flexmoe_plan import (Expand, FlexCostModel, Migrate, Shrink, apply_ops,
                                                          balance_ratio, make_scheduling_plan, net_primitives,
                                                          schedule)
from megatron_moe.techniques.flexmoe.flexmoe_policy import (amortize_steps, check_flexmoe_config, escape_plan,
                                                            straggler_plan)
from megatron_moe.techniques.flexmoe.vexpert_base import MOVES, SlotBalancer, check_options
from megatron_moe.perf.hardware import BALANCER_OPS, PROFILE_NEEDS, configured_profile, expert_shape
from megatron_moe.config.validate import expert_proj_bias, section_check
from megatron_moe.distributed.parallel_state import SIDE_CHANNELS

_KIND = {Expand: "expand", Shrink: "shrink", Migrate: "migrate"}


def primitive_counts(ops) -> dict:
    """{kind: count} of the net primitives of one decision (`flexmoe_plan.net_primitives`: an
    Expand and a Shrink of one expert on one GPU count as neither)."""
    return dict(Counter(_KIND[type(op)] for op in net_primitives(ops)))


def flexmoe_slots_per_rank(cfg, ep_size: int) -> int:
    """`moe.flexmoe.slots_per_rank`, null = E/ep + 1."""
    configured = cfg.moe.flexmoe.slots_per_rank
    return configured if configured is not None else cfg.moe.num_experts // ep_size + 1


@BALANCERS.register("flexmoe")
class FlexMoE(SlotBalancer):
    """vExperts with Expand / Shrink / Migrate chosen by Alg. 1-2 on the Eq. 5-9 cost model."""

    def __init__(self, cfg, state):
        fm = cfg.moe.flexmoe
        super().__init__(cfg, state, flexmoe_slots_per_rank(cfg, state.ep_size), fm.interval, fm.moves)
        self.threshold, self.trigger = fm.threshold, fm.trigger
        self.policy = straggler_plan if fm.policy == "straggler" else make_scheduling_plan
        self.escape = escape_plan if fm.policy == "straggler" else None
        profile = configured_profile(cfg, BALANCER_OPS, "moe.balancer=flexmoe")
        shape = expert_shape(cfg, state)
        params = shape.params(expert_proj_bias(cfg), state.esp_size)
        self.cost = FlexCostModel(seconds_per_token=3 * shape.flops_per_row * profile.expert_compute.beta,
                                  seconds_per_token_sent=cfg.model.hidden_size * profile.p2p.beta,
                                  seconds_per_param_sent=profile.p2p.beta, params_per_expert=params,
                                  state_params_per_expert=3 * params, amortize_steps=amortize_steps(fm))

    def wants_decision(self, iteration: int) -> bool:
        return self.trigger == "threshold" or super().wants_decision(iteration)

    def triggered(self, load: np.ndarray) -> bool:
        """Alg. 1 line 3: the balance ratio (Eq. 6) of the window's loads exceeds the threshold."""
        return self.trigger == "interval" or balance_ratio(load.sum(0), self.table.slots) > self.threshold

    def propose(self, load: np.ndarray):
        ops = schedule(load, self.table.slots, self.cost, self.threshold, self.policy, self.escape)
        if not ops:
            return None, {}
        return apply_ops(self.table.slots, ops), primitive_counts(ops)


@section_check("moe.flexmoe")
def _check_flexmoe(cfg, world_size: int) -> None:
    """Enough vExpert slots for every expert, a sane schedule (checked with moe.balancer=flexmoe only)."""
    moe = cfg.moe
    if moe.balancer != "flexmoe":
        return
    check_flexmoe_config(cfg)
    per_rank, fm = moe.num_experts // cfg.parallel.expert, moe.flexmoe
    check_options([("flexmoe.slots_per_rank", fm.slots_per_rank,
                    fm.slots_per_rank is None or fm.slots_per_rank >= per_rank,
                    f">= moe.num_experts / parallel.expert = {per_rank}, the experts a rank starts with; use "
                    f"{per_rank} or more (or null = {per_rank + 1})"),
                   ("flexmoe.interval", fm.interval, fm.interval >= 1, ">= 1"),
                   ("flexmoe.threshold", fm.threshold, fm.threshold >= 1.0, ">= 1.0 (a balance ratio)"),
                   ("flexmoe.moves", fm.moves, fm.moves in MOVES, f"one of {', '.join(MOVES)}")])


@SIDE_CHANNELS.register("flexmoe")
def _side_channels(cfg) -> list:
    """Best-effort moves stay in flight while the next forward's collectives run on ``ep``: they
    travel on a side channel of it (FlexMoE §4: "a separate CUDA stream")."""
    return ["ep"] if cfg.moe.balancer == "flexmoe" and cfg.moe.flexmoe.moves == "best_effort" else []


@PROFILE_NEEDS.register("flexmoe")
def _profile_needs(cfg) -> list:
    return [(BALANCER_OPS, "moe.balancer=flexmoe")] if cfg.moe.balancer == "flexmoe" else []
