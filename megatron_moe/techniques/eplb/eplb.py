"""DeepSeek's Expert Parallelism Load Balancer as a training balancer (`moe.balancer: eplb`).

The replica planner of DeepSeek-V3's deployment (arXiv:2412.19437 §3.4; deepseek-ai/EPLB, written
from scratch in `eplb_plan.py`), executed on the persistent vExpert slots of `moe/vexperts.py`
(the same slots, moves and routing as FlexMoE). Every EP rank has (E + `moe.eplb.redundant_slots`)
/ ep slots, all filled once the first plan runs. Every `moe.eplb.interval` iterations, per layer:

    load  = moving average of each expert's rows per iteration (`moe.eplb.ema`: weight of the
            newest window)
    plan  = replicate the heaviest experts (by load per replica) into the redundant slots, pack
            the replicas onto ranks by balanced greedy packing; hierarchical per
            `moe.eplb.hierarchical` (`eplb_ranks_per_node`; by default only when the gate is
            group-limited, as in DeepSeek's EPLB): the router's groups (`moe.router_groups`)
            packed onto nodes first, so a token's experts sit in at most `router_group_topk`
            nodes; without router groups, single experts

EPLB ignores what a move costs (it was built for inference, where a re-plan is rare); each rank's
new experts keep the slots they already had, so only the cells that change move. The FlexMoE
docs section compares the two on the same traces.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from megatron_moe.moe.balancers import BALANCERS
from megatron_moe.techniques.eplb.eplb_plan import rebalance
from megatron_moe.distributed.parallel_state import RankLayout
from megatron_moe.techniques.flexmoe.vexpert_base import (SlotBalancer, block_ranks_per_node, check_options,
                                                          ep_ranks_per_node)
from megatron_moe.config.validate import section_check


def eplb_slots_per_rank(cfg, ep_size: int) -> int:
    """(E + `moe.eplb.redundant_slots`) / ep; redundant_slots null = one per EP rank (none on one)."""
    redundant = cfg.moe.eplb.redundant_slots
    if redundant is None:
        redundant = ep_size if ep_size > 1 else 0
    return (cfg.moe.num_experts + redundant) // ep_size


HIERARCHICAL = ("auto", "true", "false")


def group_limited(cfg) -> bool:
    """Whether the gate routes each token to a limited set of expert groups (`moe.router_groups`
    > 1 with `moe.router_group_topk`, moe/router.py)."""
    return cfg.moe.router_groups > 1


def eplb_ranks_per_node(cfg, state) -> Optional[int]:
    """EP ranks per node for the hierarchical plan, or None for the global one. `moe.eplb.hierarchical`:
    auto = hierarchical only under group-limited routing (DeepSeek ties the two: its node-limited
    gate keeps a token's experts in few nodes, the plan keeps each group's experts and replicas in
    one node); true = whenever the ``ep`` group spans nodes; false = never. One EP rank per node:
    no replica could stay inside its node (the plan would refuse any redundant slot), so the plan
    is global."""
    return _planned_ranks_per_node(cfg, ep_ranks_per_node(state))


def _planned_ranks_per_node(cfg, per_node: Optional[int]) -> Optional[int]:
    """`eplb_ranks_per_node` given the ``ep`` group's EP ranks per node (`ep_ranks_per_node`)."""
    mode = str(cfg.moe.eplb.hierarchical).lower()
    if mode == "false" or (mode == "auto" and not group_limited(cfg)):
        return None
    return per_node if per_node is not None and per_node > 1 else None


def hierarchical_groups(cfg, ep_size: int, per_node: Optional[int]) -> int:
    """The expert groups the hierarchical plan packs onto nodes (`rebalance`'s `groups`): the
    router's `moe.router_groups` (1: single experts). `per_node`: `eplb_ranks_per_node` (None: the
    global plan, which ignores groups). ConfigError when the groups do not divide evenly over the
    ``ep`` group's nodes: a group split over two nodes is what the plan exists to prevent."""
    from megatron_moe.config.errors import ConfigError

    groups = cfg.moe.router_groups
    if per_node is not None and groups > 1 and groups % (ep_size // per_node):
        raise ConfigError(f"moe.router_groups={groups} does not divide evenly over the {ep_size // per_node} nodes "
                          f"of the ep group ({per_node} EP ranks each): hierarchical EPLB packs whole router groups "
                          "onto nodes (moe.eplb.hierarchical=false plans globally)")
    return groups


def check_eplb_config(cfg) -> None:
    """`moe.eplb.hierarchical` (called by this technique's section check)."""
    from megatron_moe.config.errors import ConfigError

    if str(cfg.moe.eplb.hierarchical).lower() not in HIERARCHICAL:
        raise ConfigError(f"moe.eplb.hierarchical={cfg.moe.eplb.hierarchical!r} must be one of auto, true, false")


def keep_in_place(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """`new` [ep, V] with each rank's experts reordered so that an expert the rank already holds
    keeps its slot (the others fill the remaining slots in ascending order)."""
    placed = np.full_like(new, -1)
    for q in range(new.shape[0]):
        todo = sorted(new[q].tolist())
        for k, e in enumerate(old[q].tolist()):
            if e in todo:
                placed[q, k] = e
                todo.remove(e)
        placed[q][placed[q] == -1] = todo
    return placed


@BALANCERS.register("eplb")
class EPLB(SlotBalancer):
    """Replicate heavy experts into redundant slots, pack replicas onto ranks (no move cost)."""

    def __init__(self, cfg, state):
        eplb = cfg.moe.eplb
        super().__init__(cfg, state, eplb_slots_per_rank(cfg, state.ep_size), eplb.interval)
        self.ema_weight = eplb.ema
        self.ranks_per_node = eplb_ranks_per_node(cfg, state)
        self.groups = hierarchical_groups(cfg, state.ep_size, self.ranks_per_node)
        self.average: Optional[np.ndarray] = None  # [E] moving average of rows per iteration

    def propose(self, load: np.ndarray):
        loads = load.sum(0)
        self.average = loads if self.average is None else \
            self.ema_weight * loads + (1 - self.ema_weight) * self.average
        plan, _ = rebalance(self.average, self.ep_size, self.slots_per_rank, self.ranks_per_node, self.groups)
        old = self.table.slots
        new = keep_in_place(old, plan)
        # a changed slot is one move (its new expert copied from another rank; the old one is
        # dropped by a tag): counted as FlexMoE counts its Expand, one primitive per transfer
        return new, {"expand": int(((new != old) & (new >= 0)).sum())}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "average": None if self.average is None else self.average.tolist()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.average = None if state.get("average") is None else np.array(state["average"], dtype=np.float64)


@section_check("moe.eplb")
def _check_eplb(cfg, world_size: int) -> None:
    """Enough slots for every expert, a sane schedule (checked with moe.balancer=eplb only)."""
    moe, ep = cfg.moe, cfg.parallel.expert
    if moe.balancer != "eplb":
        return
    check_eplb_config(cfg)
    eplb = moe.eplb
    redundant = eplb.redundant_slots if eplb.redundant_slots is not None else (ep if ep > 1 else 0)
    check_options([("eplb.interval", eplb.interval, eplb.interval >= 1, ">= 1"),
                   ("eplb.ema", eplb.ema, 0.0 < eplb.ema <= 1.0, "in (0, 1]"),
                   ("eplb.redundant_slots", eplb.redundant_slots,
                    redundant >= 0 and (moe.num_experts + redundant) % ep == 0
                    and (moe.num_experts + redundant) // ep <= moe.num_experts,
                    f">= 0 with moe.num_experts + it divisible by parallel.expert={ep} and at most "
                    f"moe.num_experts slots per rank (or null = {ep if ep > 1 else 0})")])
    par = cfg.parallel  # the router groups over the nodes, when the nodes are known before start-up
    if par.ranks_per_node and world_size % (par.tensor * par.pipeline) == 0 and world_size % par.ranks_per_node == 0 \
            and (world_size // par.pipeline) % (ep * par.expert_shard) == 0:
        layout = RankLayout(world_size, par.tensor, par.pipeline, ep, par.expert_shard, par.ranks_per_node)
        for ranks in layout.groups("ep"):
            hierarchical_groups(cfg, ep, _planned_ranks_per_node(cfg, block_ranks_per_node(ranks, par.ranks_per_node)))
