"""DeepSeek's Expert Parallelism Load Balancer as a training balancer (`moe.balancer: eplb`).

The replica planner of DeepSeek-V3's deployment (arXiv:2412.19437 §3.4; deepseek-ai/EPLB, written
from scratch in `eplb_plan.py`), executed on the persistent vExpert slots of `moe/vexperts.py`
(the same slots, moves and routing as FlexMoE). Every EP rank has (E + `moe.eplb.redundant_slots`)
/ ep slots, all filled once the first plan runs. Every `moe.eplb.interval` iterations, per layer:

    load  = moving average of each expert's rows per iteration (`moe.eplb.ema`: weight of the
            newest window)
    plan  = replicate the heaviest experts (by load per replica) into the redundant slots, pack
            the replicas onto ranks by balanced greedy packing; hierarchical per
            `moe.eplb.hierarchical` (`eplb_ranks_per_node`; by default only when group-limited
            routing limits the nodes a token reaches, `node_limited`): the router's groups
            (`moe.router_groups`) packed onto nodes first, so a token's experts sit in at most
            `router_group_topk` nodes; without router groups, single experts

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
from megatron_moe.techniques.flexmoe.vexpert_base import SlotBalancer, block_ranks_per_node, ep_ranks_per_node
from megatron_moe.config.validate import section_check


def eplb_slots_per_rank(cfg, ep_size: int) -> int:
    """(E + `moe.eplb.redundant_slots`) / ep; redundant_slots null = one per EP rank (none on one)."""
    redundant = cfg.moe.eplb.redundant_slots
    if redundant is None:
        redundant = ep_size if ep_size > 1 else 0
    return (cfg.moe.num_experts + redundant) // ep_size


HIERARCHICAL = ("auto", "true", "false")


def node_limited(cfg, nodes: int) -> bool:
    """Whether group-limited routing keeps each token's experts in fewer of the ``ep`` group's
    `nodes` than it could reach anyway, once the hierarchical plan puts each router group in one
    node: a token's experts then lie in at most `moe.router_group_topk` groups, hence nodes, and
    without the groups in at most min(`moe.top_k`, nodes); so router_group_topk < min(top_k, nodes).
    Otherwise (router_group_topk = router_groups, >= nodes or >= top_k) the groups limit no token's
    nodes and the plan would only pack coarser items. deepseek-ai/EPLB's hierarchical policy exists
    for group-limited routing (its README: same-group experts on one node to cut inter-node
    traffic), i.e. DeepSeek-V3's node-limited routing (§2.1.2: each token to at most M nodes, 4 of 8)."""
    moe = cfg.moe
    if moe.router_groups <= 1 or moe.router_group_topk is None:
        return False
    return moe.router_group_topk < min(moe.top_k, nodes)


def eplb_ranks_per_node(cfg, state) -> Optional[int]:
    """EP ranks per node for the hierarchical plan, or None for the global one. `moe.eplb.hierarchical`:
    auto = hierarchical only when group-limited routing limits the nodes a token reaches
    (`node_limited`: DeepSeek ties the two, its node-limited gate keeps a token's experts in few
    nodes, the plan keeps each group's experts and replicas in one node); true = whenever the ``ep``
    group spans nodes; false = never. One EP rank per node: no replica could stay inside its node
    (the plan would refuse any redundant slot), so the plan is global."""
    return planned_ranks_per_node(cfg, state.ep.size, ep_ranks_per_node(state))


def planned_ranks_per_node(cfg, ep_size: int, per_node: Optional[int]) -> Optional[int]:
    """`eplb_ranks_per_node` given the ``ep`` group's size and EP ranks per node (`ep_ranks_per_node`)."""
    mode = str(cfg.moe.eplb.hierarchical).lower()
    if mode == "false" or per_node is None or per_node <= 1:
        return None
    return per_node if mode == "true" or node_limited(cfg, ep_size // per_node) else None


def hierarchical_groups(cfg, ep_size: int, per_node: Optional[int]) -> int:
    """The expert groups the hierarchical plan packs onto nodes (`rebalance`'s `groups`): the
    router's `moe.router_groups` (1: single experts). `per_node`: `eplb_ranks_per_node` (None: the
    global plan, which ignores groups). ConfigError when the groups do not divide evenly over the
    ``ep`` group's nodes: a group split over two nodes is what the plan exists to prevent."""
    from megatron_moe.config.errors import ConfigError

    groups = cfg.moe.router_groups
    if per_node is not None and groups > 1 and groups % (ep_size // per_node):
        nodes = ep_size // per_node
        near = _nearest(groups, [g for g in range(nodes, cfg.moe.num_experts + 1, nodes) if _router_groups_ok(cfg, g)])
        use = f"use moe.router_groups={' or '.join(map(str, near))}, or " if near else "use "
        raise ConfigError(f"moe.router_groups={groups} does not divide evenly over the {nodes} nodes of the ep group "
                          f"({per_node} EP ranks each), and hierarchical EPLB packs whole router groups onto nodes; "
                          f"{use}moe.eplb.hierarchical=false (plans globally)")
    return groups


def _router_groups_ok(cfg, groups: int) -> bool:
    """Whether the router takes `groups` groups with the config's `moe.router_group_topk` (moe/router.py)."""
    moe = cfg.moe
    topk = moe.router_group_topk or 1
    return moe.num_experts % groups == 0 and topk <= groups and topk * (moe.num_experts // groups) >= moe.top_k


def _nearest(value: int, valid) -> list:
    """The largest of `valid` below `value` and the smallest above it (those that exist)."""
    below, above = [v for v in valid if v < value], [v for v in valid if v > value]
    return ([max(below)] if below else []) + ([min(above)] if above else [])


def redundant_slots_error(cfg, ep_size: int, per_node: Optional[int] = None) -> Optional[str]:
    """The one rule `moe.eplb.redundant_slots` R breaks on an ``ep`` group of `ep_size` ranks, with
    the nearest valid values, or None. E experts (a multiple of ep_size). Valid: R >= 0, E + R slots
    dividing over the ranks, and at most E slots per rank (a rank holds an expert at most once), or
    at most the E / nodes experts of its node under the hierarchical plan (`per_node`: EP ranks per
    node, `planned_ranks_per_node`; None: global), so R <= E (ranks - 1), resp. E (per_node - 1)."""
    redundant, experts = cfg.moe.eplb.redundant_slots, cfg.moe.num_experts
    if redundant is None:
        return None  # null = ep_size (0 on one rank): always valid
    default = f"(or null = {ep_size if ep_size > 1 else 0})"
    key = f"moe.eplb.redundant_slots={redundant}"
    most = experts * ((per_node or ep_size) - 1)  # E + most fills exactly the per-rank bound on every rank
    if redundant < 0:
        return f"{key} is negative; use 0 (no replica) or more {default}"
    if redundant > most:
        cap = "0" if most == 0 else f"{most} or less"
        slots = f"{key}: {experts + redundant} slots over parallel.expert={ep_size} ranks exceed"
        if per_node is None:
            return (f"{slots} moe.num_experts={experts} per rank (a rank holds an expert at most once); "
                    f"use {cap} {default}")
        return (f"{slots} the {experts * per_node // ep_size} experts of a node per rank (the hierarchical plan keeps "
                f"an expert's replicas in its node of {per_node} EP ranks, and a rank holds an expert at most once); "
                f"use {cap} {default}, or moe.eplb.hierarchical=false")
    if (experts + redundant) % ep_size:
        below = redundant - redundant % ep_size
        return (f"{key}: moe.num_experts + redundant_slots = {experts + redundant} slots do not divide over "
                f"parallel.expert={ep_size} ranks; use {below} or {below + ep_size} {default}")
    return None


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
        problem = redundant_slots_error(cfg, state.ep_size, self.ranks_per_node)  # nodes known only now
        if problem:
            from megatron_moe.config.errors import ConfigError
            raise ConfigError(problem)
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
    """Enough slots for every expert, a sane schedule (checked with moe.balancer=eplb only); each
    message names the one rule broken and the nearest valid values."""
    from megatron_moe.config.errors import ConfigError

    moe, ep = cfg.moe, cfg.parallel.expert
    if moe.balancer != "eplb":
        return
    check_eplb_config(cfg)
    eplb = moe.eplb
    if eplb.interval < 1:
        raise ConfigError(f"moe.eplb.interval={eplb.interval} is below 1 (EPLB re-plans every `interval` "
                          "iterations); use 1 (every iteration) or more")
    if not 0.0 < eplb.ema <= 1.0:
        raise ConfigError(f"moe.eplb.ema={eplb.ema}: the newest window's weight in the moving average of the loads "
                          + ("must be > 0 (0 never updates them); use a weight in (0, 1], e.g. 0.5 (the default)"
                             if eplb.ema <= 0 else "is at most 1; use 1.0 (the newest window only) or less"))
    planned = [None]  # EP ranks per node of each ep group's plan (None: global), when known before start-up
    par = cfg.parallel
    if par.ranks_per_node and world_size % (par.tensor * par.pipeline) == 0 and world_size % par.ranks_per_node == 0 \
            and (world_size // par.pipeline) % (ep * par.expert_shard) == 0:
        layout = RankLayout(world_size, par.tensor, par.pipeline, ep, par.expert_shard, par.ranks_per_node)
        planned = [planned_ranks_per_node(cfg, ep, block_ranks_per_node(ranks, par.ranks_per_node))
                   for ranks in layout.groups("ep")]
    for per_node in planned:  # the router groups over the nodes
        hierarchical_groups(cfg, ep, per_node)
    if moe.num_experts % ep == 0:  # otherwise the layout check reports parallel.expert first
        problem = redundant_slots_error(cfg, ep, min(planned, key=lambda n: n or ep))  # the tightest bound
        if problem:
            raise ConfigError(problem)
