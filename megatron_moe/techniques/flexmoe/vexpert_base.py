"""What the persistent-replica balancers (FlexMoE, EPLB) share (`moe/vexperts.py` has the mechanism).

Per layer, every iteration:

* `plan`: FlexMoE's flexible token routing (Alg. 3, `flexmoe_plan.flexible_routing`) over the
  current slots, rounded to whole rows (`vexperts.integer_routing`): each source's rows of an
  expert stay on its own rank up to that rank's share of the expert, the rest go to the other
  holders by free capacity. The result is a `Placement.on_slots`, so every schedule executes it.
* `observe`: adds the forward's rows per (source EP rank, expert) to the decision window.
* `before_grad_sync`: the ranks holding each expert sum their gradients (`sync_replica_grads`).
* `after_optimizer_step`: every `interval` iterations the window is averaged over the ``edp``
  groups (one all-reduce, so every rank decides the same) and over its iterations, the subclass
  proposes new slots (`propose`), and `vexpert_moves.MovesInFlight` moves weights and AdamW
  moments there: completed at once (`moves = "sync"`), or left in flight until the layer's next
  forward (`"best_effort"`, FlexMoE §4; `complete_moves`, called by `MoELayer.forward`, a
  checkpoint save and the end of training).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from megatron_moe.distributed import collectives as C
from megatron_moe.moe.balancers.base import Balancer
from megatron_moe.techniques.fastermoe.fastermoe import rows_per_rank
from megatron_moe.techniques.flexmoe.flexmoe_plan import flexible_routing
from megatron_moe.moe.placement import Placement
from megatron_moe.moe.vexpert_moves import MovesInFlight, reshape_storage
from megatron_moe.moe.vexperts import integer_routing, sync_replica_grads
from megatron_moe.perf.host_sync import to_host
from megatron_moe.config.errors import ConfigError

OP_KINDS = ("expand", "shrink", "migrate")
MOVES = ("sync", "best_effort")  # when a round of moves completes (`moe.flexmoe.moves`)


class SlotBalancer(Balancer):
    """Base of balancers whose replicas are persistent vExpert slots."""

    late_expert_grads = "vExpert slots sum their gradients after backward (before_grad_sync)"

    def __init__(self, cfg, state, slots_per_rank: int, interval: int, moves: str = "sync"):
        super().__init__(cfg, state)
        self.state, self.slots_per_rank, self.interval, self.moves = state, slots_per_rank, interval, moves
        self.in_flight: Optional[MovesInFlight] = None  # best-effort: the round the next forward completes
        self.window = np.zeros((self.ep_size, self.num_experts))  # rows per (source EP rank, expert)
        self.window_iterations = 0
        self.ops_total: Dict[str, int] = {kind: 0 for kind in OP_KINDS}
        self.experts = None

    def attach(self, experts) -> None:
        self.experts = experts

    @property
    def table(self):
        return self.experts.slot_table

    def plan(self, counts: torch.Tensor, source_ep_ranks: List[int]) -> Placement:
        counts_np = counts.long().numpy()
        routing = flexible_routing(counts_np, source_ep_ranks, self.table.slots)  # Alg. 3, per (expert, holder)
        table = integer_routing(routing.values, counts_np, routing.experts, routing.ranks, self.ep_size)
        return Placement.on_slots(table, [self.table.resident(q) for q in range(self.ep_size)])

    def observe(self, counts: torch.Tensor, source_ep_ranks: List[int]) -> None:
        self.window += rows_per_rank(counts, source_ep_ranks, self.ep_size).numpy()

    def before_grad_sync(self) -> None:
        sync_replica_grads(self.experts.stacks(), self.table, self.state.ep)

    def after_optimizer_step(self, iteration: int, optimizer) -> int:
        self.complete_moves()  # a round still in flight (a forward-less caller) lands before the next
        self.window_iterations += 1
        self.last_moves = 0
        if not self.wants_decision(iteration):
            return 0
        window = self.window
        if self.state.edp_size > 1:  # every ep_esp group saw its own tokens: decide on their mean
            edp = self.state.edp  # [ep, E] float64 on edp's device (NCCL: the GPU), read back once per interval
            summed = C.all_reduce(edp.to_device(torch.from_numpy(self.window.copy())), edp, kind="vexpert_plan")
            window = to_host(summed, "vexpert window").numpy() / self.state.edp_size  # once per interval
        new_slots = self.decide(window)
        if new_slots is not None:  # the state as of this step goes out now; it lands now or before the next forward
            self.in_flight = MovesInFlight(self.experts, new_slots, optimizer, self.state.ep)
            if self.moves == "sync":
                self.complete_moves()
        return self.last_moves

    def complete_moves(self) -> None:
        """Install the round of moves in flight, if any (waits for this rank's transfers)."""
        if self.in_flight is not None:
            moves, self.in_flight = self.in_flight, None
            moves.complete()

    @property
    def planned_slots(self) -> np.ndarray:
        """The slot table once the moves in flight have landed (the current one if none are)."""
        return self.in_flight.new if self.in_flight is not None else self.table.slots

    def wants_decision(self, iteration: int) -> bool:
        """Whether this iteration all-reduces the window and calls `decide` (every `interval`)."""
        return iteration % self.interval == 0

    def triggered(self, load: np.ndarray) -> bool:
        """Whether `load` [ep, E] (rows per iteration) calls for a plan; the window keeps growing
        (up to `interval` iterations) while it does not."""
        return True

    def decide(self, window: np.ndarray) -> Optional[np.ndarray]:
        """The decision of one interval, without communication (the cluster simulator calls it too):
        `window` [ep, E] = rows per (source EP rank, expert) summed over the window's forwards and
        averaged over the ``edp`` groups -> the new slots Int[ep, V], or None when they stay.
        Clears the window (when it plans, or once it holds `interval` iterations) and counts the
        primitives (`ops_total`, `last_moves`)."""
        load = window / max(self.window_iterations, 1)  # [ep, E] rows per iteration
        if not self.triggered(load):
            if self.window_iterations >= self.interval:
                self.window[:], self.window_iterations = 0.0, 0
            return None
        self.window[:], self.window_iterations = 0.0, 0
        new_slots, ops = self.propose(load)
        for kind in OP_KINDS:
            self.ops_total[kind] += ops.get(kind, 0)
        self.last_moves = sum(ops.values())
        changed = new_slots is not None and not np.array_equal(new_slots, self.table.slots)
        return new_slots if changed else None

    def propose(self, load: np.ndarray):
        """load [ep, E] (mean rows per iteration from each EP rank's sources to each expert) ->
        (new slots Int[ep, V] or None, {op kind: primitives that give them})."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        assert self.in_flight is None, "complete_moves() before saving: the storage must match the slots"
        return {"slots": self.table.slots.tolist(), "window": self.window.tolist(),
                "window_iterations": self.window_iterations, "ops_total": dict(self.ops_total)}

    def load_state_dict(self, state: dict) -> None:
        """The saved slots, with the parameter stacks re-shaped to them (a checkpoint load fills
        the rows next; `vexpert_moves.fit_optimizer_rows` re-shapes the optimizer's state)."""
        self.complete_moves()
        reshape_storage(self.experts, state["slots"])
        self.window = np.array(state["window"], dtype=np.float64).reshape(self.window.shape)
        self.window_iterations = int(state["window_iterations"])
        self.ops_total = {kind: int(state["ops_total"].get(kind, 0)) for kind in OP_KINDS}


def ep_ranks_per_node(state) -> Optional[int]:
    """EP ranks per node when the ``ep`` group's nodes (`parallel.ranks_per_node`) are equal
    blocks of consecutive EP ranks; None when it sits on one node or is spread otherwise."""
    group = state.ep
    return block_ranks_per_node([group.global_rank(q) for q in range(group.size)], group.ranks_per_node)


def block_ranks_per_node(ranks: Sequence[int], ranks_per_node: Optional[int]) -> Optional[int]:
    """`ep_ranks_per_node` of a group given as its global ranks in group order, on nodes of
    `ranks_per_node` consecutive global ranks (None: one node)."""
    nodes = [rank // ranks_per_node for rank in ranks] if ranks_per_node else []
    if len(set(nodes)) <= 1:
        return None
    size = len(ranks)
    per_node = size // len(set(nodes))
    if size % len(set(nodes)) or nodes != sorted(nodes) or any(
            nodes[q] != nodes[q - q % per_node] for q in range(size)):
        return None
    return per_node


def check_options(checks) -> None:
    """[(key under moe., value, ok, rule)]: ConfigError for the first not ok (FlexMoE's, EPLB's sections)."""
    for key, value, ok, rule in checks:
        if not ok:
            raise ConfigError(f"moe.{key}={value} must be {rule}")
