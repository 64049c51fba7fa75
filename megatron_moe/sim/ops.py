"""Simulated operations: what every rank sends, counts and spends on one collective or computation.

An `Op` holds arrays over the simulated world [W]: its `traffic`, the bytes
`distributed/collectives.py` would count on each rank under ``"<kind>/<group>"`` (and the part
sent to other nodes), and `cost(k)`, each rank's seconds for one of k equal parts of the op (k = 1:
the whole op; Lancet's partitioned forward asks for k > 1). Builders:

* `exchange`: an all-to-all-v or a batch of point-to-point messages, from the matrix of elements
  each member of every group sends each other member;
* `collective`: a group collective (all-gather, all-reduce, broadcast, ...) given its x per rank;
* `compute`: FLOPs per rank.

Element widths (`Widths`, from `training.precision`): bf16 runs send activations and tokens
(all-to-all, TP sums and gathers, stage messages) and the weights of Trans and of ZeRO-1's
all-gather in 2 bytes; gradients (fp32 main gradients), vExpert moves (fp32 master and moments),
routing probabilities and metadata keep theirs. Costs are per byte: the hardware profile's
alpha-beta fits are per fp32 element (`PROFILE_ELEMENT_BYTES`), so x elements of b bytes cost
as x b / 4 of them.

`mode` says how the timeline (`sim/timeline.py`) runs it: ``sync`` (a collective: it starts when
every member of the rank's `group` is ready, and they all end together), ``compute`` (the rank
alone), ``issue`` / ``wait`` (an asynchronous transfer started on a side channel, and the point
where its result is needed; `handle` pairs them), ``mark`` (where the timeline issues the ops
registered for its handle).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional

import numpy as np

from megatron_moe.sim.cluster import Cluster
from megatron_moe.sim.layout import WorldLayout

Cost = Callable[[int], np.ndarray]  # parts -> seconds [W] of one part


@dataclass
class Traffic:
    key: str  # "<kind>/<group>", as collectives.py counts it
    counted: np.ndarray  # [W] bytes
    inter: Optional[np.ndarray] = None  # [W] of which sent to ranks on other nodes (all-to-all, point to point)


@dataclass
class Op:
    name: str  # breakdown label ("dispatch", "experts", "trans", ...)
    mode: str  # sync | compute | issue | wait
    cost: Cost
    group: str = ""  # the group a sync / issue op runs on
    traffic: List[Traffic] = field(default_factory=list)
    handle: str = ""  # issue / wait pairing
    deferrable: float = 0.0  # backward compute: the fraction that is weight gradients (Lancet defers it)
    a2a: bool = False  # a token all-to-all (Lancet's deferred dW runs inside the backward ones)
    comm: Optional[float] = None  # a compute-mode op's breakdown kind (2: overlap), default computation
    duration: Optional[np.ndarray] = None  # [W] what the op occupies when more than its exposed cost (a pipeline)

    def seconds(self, parts: int = 1) -> np.ndarray:
        return self.cost(parts)

    def masked(self, keep: np.ndarray) -> "Op":
        """This op on the ranks in `keep` [W] only (no bytes, no time elsewhere)."""
        scale = keep.astype(np.float64)
        return replace(self, cost=lambda k, c=self.cost: c(k) * scale,
                       traffic=[Traffic(t.key, t.counted * scale, None if t.inter is None else t.inter * scale)
                                for t in self.traffic])

    def joined(self, other: "Op", cost: Cost) -> "Op":
        """One op timed by `cost` that counts both ops' bytes (SAA: its exchange and its gathers)."""
        return replace(self, cost=cost, traffic=self.traffic + other.traffic)


PROFILE_ELEMENT_BYTES = 4  # the hardware profiles' beta: seconds per fp32 element


@dataclass(frozen=True)
class Widths:
    """Bytes per element by role (module docstring)."""

    activation: int = 4  # tokens and activations
    weight: int = 4  # parameters as sent (Trans, ZeRO-1's all-gather)

    @classmethod
    def of(cls, precision: str) -> "Widths":
        width = 2 if precision == "bf16" else 4
        return cls(width, width)


def profile_elements(elements, element_bytes: int):
    """`elements` of `element_bytes` as the fp32 elements the profile's costs are fitted on."""
    return np.asarray(elements, dtype=np.float64) * (element_bytes / PROFILE_ELEMENT_BYTES)


class OpBuilder:
    """Op constructors on one world and cluster."""

    def __init__(self, world: WorldLayout, cluster: Cluster, widths: Widths = Widths()):
        self.world, self.cluster, self.widths = world, cluster, widths

    def zeros(self) -> np.ndarray:
        return np.zeros(self.world.size)

    def members(self, group: str) -> np.ndarray:
        return self.world.members(group)

    def split(self, group: str, elements: np.ndarray):
        """elements [G, n, n] (member i to member j) -> [W] arrays (sent, sent to other ranks on
        the node, sent off the node, received on the node, received from off the node)."""
        members = self.members(group)
        nodes = self.world.node[members]
        same = nodes[:, :, None] == nodes[:, None, :]  # [G, n, n]
        near = same & ~np.eye(members.shape[1], dtype=bool)[None]
        x = np.asarray(elements, dtype=np.float64)
        arrays = [x.sum(2), (x * near).sum(2), (x * ~same).sum(2), (x * near).sum(1), (x * ~same).sum(1)]
        out = []
        for a in arrays:
            w = self.zeros()
            w[members] = a
            out.append(w)
        return out

    def exchange(self, name: str, kind: str, group: str, elements: np.ndarray, element_bytes: int,
                 counts_own: bool = True, cost_kind: str = "all_to_all", mode: str = "sync",
                 handle: str = "", a2a: bool = False) -> Op:
        """elements [G, n, n]: what member i of group g sends member j. `counts_own`: the counter
        includes what a rank keeps for itself (an all-to-all's input) or not (point to point)."""
        total, sent_on, sent_off, recv_on, recv_off = self.split(group, elements)
        counted = (total if counts_own else sent_on + sent_off) * element_bytes
        if self.world.group_size[group] == 1:
            counted = self.zeros()
        on = profile_elements(np.maximum(sent_on, recv_on), element_bytes)
        off = profile_elements(np.maximum(sent_off, recv_off), element_bytes)
        cluster = self.cluster
        return Op(name, mode, lambda k: cluster.exchange(cost_kind, on / k, off / k), group,
                  [Traffic(f"{kind}/{group}", counted, sent_off * element_bytes)], handle, a2a=a2a)

    def collective(self, name: str, kind: str, group: str, elements, element_bytes: int, cost_kind: str,
                   counted_factor=1.0, mode: str = "sync", handle: str = "", calls: int = 1) -> Op:
        """A group collective with x = `elements` [W] per rank (collectives.py's convention), run
        `calls` times back to back (its start-up paid each time); counted bytes = x x bytes x
        `counted_factor` (all-gather / all-reduce / reduce-scatter: 1 on every rank; broadcast and
        reduce pass their own [W])."""
        world, cluster = self.world, self.cluster
        x = np.broadcast_to(np.asarray(elements, dtype=np.float64), (world.size,))
        counted = self.zeros() if world.group_size[group] == 1 else x * element_bytes * counted_factor
        spans = world.spans_nodes[group]
        fp32 = profile_elements(x, element_bytes)

        def cost(k):
            t = cluster.collective(cost_kind, group, fp32 / k)
            if calls > 1:
                link = cluster.link(cost_kind)
                t = t + (calls - 1) * np.where(t > 0, np.where(spans, (link.inter or link.intra).alpha,
                                                               link.intra.alpha), 0.0)
            return t

        return Op(name, mode, cost, group, [Traffic(f"{kind}/{group}", counted)], handle)

    def compute(self, name: str, flops, dense: bool = False, deferrable: float = 0.0) -> Op:
        flops = np.broadcast_to(np.asarray(flops, dtype=np.float64), (self.world.size,))
        cluster = self.cluster
        return Op(name, "compute", lambda k: cluster.compute(flops / k, dense), deferrable=deferrable)

    def wait(self, name: str, handle: str) -> Op:
        return Op(name, "wait", lambda k: self.zeros(), handle=handle)

    def mark(self, handle: str) -> Op:
        """A point in the op sequence where the timeline issues whatever is registered for `handle`
        (a layer's Trans, the next layer's prefetched Trans, Agg)."""
        return Op(handle, "mark", lambda k: self.zeros(), handle=handle)


def traffic_of(ops: List[Op]) -> Dict[str, np.ndarray]:
    """{"<kind>/<group>": bytes [W]} counted by `ops`."""
    out: Dict[str, np.ndarray] = {}
    for op in ops:
        for t in op.traffic:
            out[t.key] = out.get(t.key, 0) + t.counted
    return out


def inter_node_traffic_of(ops: List[Op]) -> Dict[str, np.ndarray]:
    out: Dict[str, np.ndarray] = {}
    for op in ops:
        for t in op.traffic:
            if t.inter is not None:
                out[t.key] = out.get(t.key, 0) + t.inter
    return out
