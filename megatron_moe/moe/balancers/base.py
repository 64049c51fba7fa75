"""Balancer interface and the owner-only policy ("none") (DESIGN.md §4).

A balancer is a policy: per-source token counts in, `Placement` out. It never moves tokens
itself; the schedule executes whatever placement it returns, so FasterMoE shadowing, FlexMoE
vExperts and Pro-Prophet plans plug in here without touching schedule code. One instance lives
in each MoE layer, so a policy may keep per-layer history.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import List, Optional

import torch

from megatron_moe.config.schema import Config
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.moe.balancers import BALANCERS
from megatron_moe.moe.placement import Placement


class NoCrossLayer:
    """No work crosses MoE layers: each layer issues its own Trans. A balancer's `cross_layer` is
    what the MoE layer calls around its experts (Pro-Prophet's: techniques/proprophet/cross_layer.py)."""

    @staticmethod
    def take_prefetched(layer, replicas):
        return None  # nothing was issued for `layer` by the block before

    @staticmethod
    def before_experts(layer, tokens_per_ep_rank) -> None:
        pass

    @staticmethod
    def after_layer(layer) -> None:
        pass

    @staticmethod
    def layer_input(layer, x):
        return x  # (Pro-Prophet: an issue point when x's gradient is complete)

    @staticmethod
    def experts_output(layer, y):
        return y  # (Pro-Prophet: an issue point when the expert output's gradient arrives)


REPLICA_AGG = "the replicas' Agg adds into the owners' gradients when backward ends (moe/replicas.py)"


class Balancer(ABC):
    # why expert gradients get additions after backward ends ('' if none): their buckets then reduce
    # after backward, not from hooks (training/grads.py `late_expert_grads`)
    late_expert_grads = ""
    plans_during_dispatch = False  # `observe` runs while the dispatch all-to-all is in flight
    prefetches_trans = False  # the block before issues this layer's Trans (techniques/proprophet/cross_layer.py)
    cross_layer = NoCrossLayer  # take_prefetched / before_experts / after_layer / layer_input / experts_output
    slots_per_rank: Optional[int] = None  # persistent vExpert slots per EP rank (moe/vexperts.py), or owners

    def __init__(self, cfg: Config, state: ParallelState):
        self.num_experts = cfg.moe.num_experts
        self.ep_size = state.ep_size
        self.last_plan_seconds = 0.0  # time `observe` spent planning in the latest forward
        self.last_moves = 0  # vExpert primitives executed after the latest optimizer step

    def attach(self, experts) -> None:
        """The layer's `Experts` (built with `slots_per_rank`), for balancers that move its state."""

    @abstractmethod
    def plan(self, counts: torch.Tensor, source_ep_ranks: List[int]) -> Placement:
        """counts Long[S, E]: kept assignments of each of the schedule's sources per expert
        (identical on every rank that executes the placement); source_ep_ranks[s]: the EP rank
        source s sits on (keeping a source's rows there needs no all-to-all). A pure function of
        its arguments and the balancer's state: Parm `auto` plans two candidates per forward."""

    def observe(self, counts: torch.Tensor, source_ep_ranks: List[int]) -> None:
        """Called once per training forward with the counts the executed placement dealt out:
        where a policy learns from this forward for the next ones (Pro-Prophet's `Plan`)."""

    def before_grad_sync(self) -> None:
        """After the iteration's backward passes, before the data-parallel gradient all-reduce
        (collective where a balancer needs it: vExperts sum their replicas' gradients)."""

    def after_optimizer_step(self, iteration: int, optimizer) -> int:
        """Collective hook after iteration `iteration`'s optimizer step (vExpert moves); returns the
        primitives executed."""
        return 0

    def complete_moves(self) -> None:
        """Finish state moves still in flight (vExperts' best-effort moves, `moe/vexpert_moves.py`):
        called by the layer's forward before it plans, before a checkpoint is saved and when
        training ends. Local (each rank waits for its own transfers)."""

    def state_dict(self) -> dict:
        """JSON-able state a checkpoint keeps (a vExpert placement and what its planner learned)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict` (only on the layout it was saved under)."""


@BALANCERS.register("none")
class OwnerOnly(Balancer):
    """No balancing: each expert's tokens all go to its owner (the classic EP placement)."""

    def plan(self, counts: torch.Tensor, source_ep_ranks: List[int]) -> Placement:
        return Placement.owner_only(counts, self.ep_size)
