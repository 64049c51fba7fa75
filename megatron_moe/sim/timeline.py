"""The simulated clock of every rank through a sequence of `Op`s (`sim/ops.py`).

Each rank has one clock (its host / compute stream) and side channels for asynchronous transfers:

    compute   the rank's clock advances by its seconds
    sync      a collective: it starts when every member of the rank's group is ready (the latest
              member clock) and lasts the slowest member's seconds; all members end together
    issue     an asynchronous transfer (Trans, Agg) on side channel `handle`: it starts when its
              group is ready and the channel is free, and does not advance the clock
    wait      the clock waits until side channel `handle` is done
    mark      issues what is registered for its handle (`Timeline.register`)

`issue_in_order` issues transfers that queue behind each other on one side channel (FlexMoE's
best-effort moves, `moe.flexmoe.moves`: each layer's round after the one before, each waited for
by its layer's first forward of the next iteration, so a round's exposed time is
max(0, when it ends - the work before that forward)).

What a rank's clock advances through an op is that op's *exposed* time (for a collective,
including the wait for the slowest member); its own duration minus what it exposed is *hidden*.
Every key is communication (1), computation (0) or overlap (2: both at once, Lancet's category).
Lancet's weight-gradient scheduling (`defer_wgrad`, techniques/lancet/lancet.py, Alg. 1): the weight-gradient
part of every backward computation (`Op.deferrable`) goes to a pool instead of the clock, and
runs during the backward token all-to-alls (`Op.a2a`) up to their duration (that stretch of the
all-to-all is "overlap", not exposed communication); what is left runs when backward ends. Not modelled: contention between a side channel and the
collectives running at the same time, and the clock skew between layers (each micro-batch starts with all ranks at 0).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Tuple

import numpy as np

from megatron_moe.sim.layout import WorldLayout
from megatron_moe.sim.ops import Op

Key = Tuple[str, str]  # (label, op name): label = "moe<l>" | "dense<l>" | "head" | "iteration"


class Timeline:
    def __init__(self, world: WorldLayout, defer_wgrad: bool = False, start=0.0):
        self.world, self.defer_wgrad = world, defer_wgrad
        self.clock = np.zeros(world.size) + start  # [S] seconds (`start`: a scalar or per rank)
        self.side: Dict[str, np.ndarray] = {}
        self.side_label: Dict[str, Key] = {}
        self.pool = np.zeros(world.size)  # deferred weight-gradient seconds not yet run
        self.exposed: Dict[Key, np.ndarray] = defaultdict(lambda: np.zeros(world.size))
        self.duration: Dict[Key, np.ndarray] = defaultdict(lambda: np.zeros(world.size))
        self.comm: Dict[Key, float] = {}  # communication (1), computation (0) or overlap (2)
        self.registered: Dict[str, List[Tuple[str, Op]]] = defaultdict(list)

    def register(self, handle: str, label: str, ops: List[Op]) -> None:
        """Issue `ops` (labelled `label`) when a `mark` op with `handle` runs."""
        self.registered[handle] += [(label, op) for op in ops]

    def run(self, ops: List[Op], label: str, backward: bool = False) -> None:
        for op in ops:
            getattr(self, f"_{op.mode}")(op, label, backward)

    # -- op kinds ---------------------------------------------------------------------------------
    def _advance(self, key: Key, new: np.ndarray, comm: float) -> None:
        self.exposed[key] += new - self.clock
        self.comm[key] = comm
        self.clock = new

    def _compute(self, op: Op, label: str, backward: bool) -> None:
        seconds = op.seconds()
        if backward and self.defer_wgrad and op.deferrable:
            deferred = seconds * op.deferrable
            self.pool += deferred
            seconds = seconds - deferred
        key = (label, op.name)
        self.duration[key] += seconds
        self._advance(key, self.clock + seconds, comm=0.0 if op.comm is None else op.comm)

    def _sync(self, op: Op, label: str, backward: bool) -> None:
        world = self.world
        seconds = world.group_max(op.group, op.seconds()) if op.group else op.seconds()
        start = world.group_max(op.group, self.clock) if op.group else self.clock
        key = (label, op.name)
        self.duration[key] += seconds if op.duration is None else op.duration
        end = start + seconds
        if backward and self.defer_wgrad and op.a2a:  # Lancet: deferred dW runs inside it
            overlap = np.minimum(np.minimum(self.pool, seconds), end - self.clock)
            self.pool -= overlap
            self._advance((label, "dw_overlap"), self.clock + overlap, comm=2.0)
        self._advance(key, end, comm=1.0)

    def _issue(self, op: Op, label: str, backward: bool = False) -> None:
        world = self.world
        seconds = world.group_max(op.group, op.seconds()) if op.group else op.seconds()
        start = world.group_max(op.group, self.clock) if op.group else self.clock
        if op.handle in self.side:
            start = np.maximum(start, self.side[op.handle])
        self.side[op.handle] = start + seconds
        self.side_label[op.handle] = (label, op.name)
        self.duration[(label, op.name)] += seconds
        self.exposed[(label, op.name)] += 0.0
        self.comm[(label, op.name)] = 1.0

    def issue_in_order(self, items: List[Tuple[str, List[Op]]]) -> None:
        """Issue now the asynchronous transfers of `items` [(label, ops)], which share one queue
        (one side channel's stream): each op starts when its group is ready and the op before it
        has ended, on its own `handle` so that each is waited for on its own (best-effort vExpert
        moves: one layer's round after the other, each waited before that layer's forward)."""
        end = None
        for label, ops in items:
            for op in ops:
                if end is not None:
                    self.side[op.handle] = np.maximum(self.side.get(op.handle, end), end)
                self._issue(op, label)
                end = self.side[op.handle]

    def _wait(self, op: Op, label: str, backward: bool) -> None:
        if op.handle in self.side:
            self._advance(self.side_label.pop(op.handle), np.maximum(self.clock, self.side.pop(op.handle)), comm=1.0)

    def _mark(self, op: Op, label: str, backward: bool) -> None:
        for issued_label, issued in self.registered.pop(op.handle, []):
            self._issue(issued, issued_label)

    def join(self, label: str, name: str, start: np.ndarray, seconds: np.ndarray) -> None:
        """A collective with ranks of other timelines (other pipeline stages, `sim/stages.py`):
        it starts at `start` [S], when every member is ready, and lasts `seconds` [S]."""
        key = (label, name)
        self.duration[key] += seconds
        self._advance(key, np.maximum(start, self.clock) + seconds, comm=1.0)

    def end_backward(self) -> None:
        """The end of a backward pass: the deferred weight gradients left run, then every transfer
        still in flight (Agg) is waited for (autograd's queue_callback)."""
        if self.pool.any():
            self.duration[("model", "deferred_dw")] += self.pool
            self._advance(("model", "deferred_dw"), self.clock + self.pool, comm=0.0)
            self.pool = np.zeros(self.world.size)
        for handle in list(self.side):
            self._advance(self.side_label.pop(handle), np.maximum(self.clock, self.side.pop(handle)), comm=1.0)
        self.registered.clear()

    # -- results ----------------------------------------------------------------------------------
    def critical_rank(self) -> int:
        return int(np.argmax(self.clock))

    def breakdown(self, rank: int) -> Dict[Key, Tuple[float, float]]:
        """{(label, op): (exposed, duration)} seconds on `rank` (its exposed times sum to its clock)."""
        return {key: (float(self.exposed[key][rank]), float(self.duration[key][rank])) for key in self.exposed}
