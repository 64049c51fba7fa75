"""The simulator's cost view of a hardware profile (`perf/hardware.py`): link alpha-beta per collective
inside and across nodes, compute throughput, and the flat profile the training cost models read.

From a profile's ``cluster`` block when it has one; otherwise from its flat ops, as one node:

    all_to_all = ep_esp_alltoall      all_gather = mp_allgather      p2p = p2p
    all_reduce = 2 x mp_allgather     (a ring all-reduce: a reduce-scatter and an all-gather of the same volume)
    broadcast  = broadcast            reduce = broadcast (the same tree, reversed)

A link the cluster block lacks falls back: broadcast -> p2p, reduce -> broadcast. Compute:
`expert_compute` (s per FLOP, the profile's), dense compute = `cluster.dense_compute` or
`expert_compute`. `saa` (Parm's measured Overlap(x)) is used as is where the profile has it.

Costs (seconds, arrays over the simulated ranks, x in elements):

* group collective on a rank's group: ``link.across(group spans nodes).time(x)``; nothing on a
  group of one rank;
* all-to-all / point to point: ``max(intra.time(max(sent, received) on the node),
  inter.time(max(sent, received) off the node))`` over the terms a rank has: the two kinds of
  link run at once, a rank's own slice costs nothing;
* compute: ``expert_compute.time(FLOPs)`` (dense: the dense throughput); none for 0 FLOPs.

`decision_profile(cluster, world)`: the flat ops (Parm Alg. 1, FasterMoE Eq. 7-10, Pro-Prophet,
FlexMoE) as start-up calibration (`training/calibrate.py`) would measure them on this layout:
mp_allgather on `tp`, ep_esp_alltoall on `ep_esp` (evenly split input: the node / off-node link
that dominates at large x, its beta times the fraction of the input it carries), p2p between EP
ranks 0 and 1, broadcast on `ep`, saa = the overlapped all-to-all and all-gather (the larger of
the two). A flat op the profile already has is kept.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, Optional

import numpy as np

from megatron_moe.config.errors import ConfigError
from megatron_moe.perf.alpha_beta import AlphaBeta
from megatron_moe.perf.hardware import HardwareProfile, Link
from megatron_moe.sim.layout import WorldLayout

FALLBACK = {"broadcast": "p2p", "reduce": "broadcast"}


class Cluster:
    """Link costs of `profile` on `world` (module docstring)."""

    def __init__(self, profile: HardwareProfile, world: WorldLayout):
        self.profile, self.world = profile, world
        spec = profile.cluster
        self.links: Dict[str, Link] = dict(spec.links) if spec is not None else _flat_links(profile)
        for kind, fallback in FALLBACK.items():
            if kind not in self.links and fallback in self.links:
                self.links[kind] = self.links[fallback]
        if profile.expert_compute is None:
            raise ConfigError(f"hardware profile {profile.name} has no expert_compute (s per FLOP): the simulator "
                              "needs compute throughput")
        self.expert_compute = profile.expert_compute
        self.dense_compute = (spec.dense_compute if spec is not None and spec.dense_compute else None) \
            or profile.expert_compute
        self.saa = profile.saa

    def link(self, kind: str) -> Link:
        if kind not in self.links:
            raise ConfigError(f"hardware profile {self.profile.name} has no '{kind}' cost (cluster.links.{kind}, or "
                              "the flat op it derives from: docs/simulator.md)")
        return self.links[kind]

    # -- costs, [W] arrays --------------------------------------------------------------------------
    def collective(self, kind: str, group: str, elements: np.ndarray) -> np.ndarray:
        """Seconds of a group collective `kind` moving `elements` [W] (collectives.py's x) on `group`."""
        if self.world.group_size[group] == 1:
            return np.zeros(self.world.size)
        link = self.link(kind)
        spans = self.world.spans_nodes[group]
        inter = link.inter or link.intra
        x = np.asarray(elements, dtype=np.float64)
        return np.where(spans, inter.alpha + inter.beta * x, link.intra.alpha + link.intra.beta * x)

    def exchange(self, kind: str, intra: np.ndarray, inter: np.ndarray) -> np.ndarray:
        """Seconds of an all-to-all or point-to-point exchange: `intra` / `inter` [W] = the larger of
        the elements a rank sends and receives on its node / across nodes."""
        link = self.link(kind)
        far = link.inter or link.intra
        on = np.where(intra > 0, link.intra.alpha + link.intra.beta * intra, 0.0)
        off = np.where(inter > 0, far.alpha + far.beta * inter, 0.0)
        return np.maximum(on, off)

    def compute(self, flops: np.ndarray, dense: bool = False) -> np.ndarray:
        ab = self.dense_compute if dense else self.expert_compute
        flops = np.asarray(flops, dtype=np.float64)
        return np.where(flops > 0, ab.alpha + ab.beta * flops, 0.0)


def _flat_links(profile: HardwareProfile) -> Dict[str, Link]:
    links = {}
    if profile.ep_esp_alltoall is not None:
        links["all_to_all"] = Link(profile.ep_esp_alltoall)
    if profile.mp_allgather is not None:
        ag = profile.mp_allgather
        links["all_gather"] = Link(ag)
        links["all_reduce"] = Link(AlphaBeta(2 * ag.alpha, 2 * ag.beta))
    for kind in ("p2p", "broadcast"):
        if getattr(profile, kind) is not None:
            links[kind] = Link(getattr(profile, kind))
    return links


def decision_profile(cluster: Cluster, name: Optional[str] = None) -> HardwareProfile:
    """The flat profile the training cost models read on `cluster.world` (module docstring)."""
    world, p = cluster.world, cluster.profile
    ops = {}

    def have(kind):
        return kind in cluster.links

    if p.mp_allgather is None and have("all_gather"):
        ops["mp_allgather"] = cluster.links["all_gather"].across(bool(world.spans_nodes["tp"][0]))
    if p.ep_esp_alltoall is None and have("all_to_all"):
        ops["ep_esp_alltoall"] = _even_alltoall(cluster)
    if p.p2p is None and have("p2p"):
        lay = world.layout
        pair = world.node[0] != world.node[min(lay.expert_shard, world.size - 1)]  # EP ranks 0 and 1 of group 0
        ops["p2p"] = cluster.links["p2p"].across(bool(pair))
    if p.broadcast is None and have("broadcast"):
        ops["broadcast"] = cluster.links["broadcast"].across(bool(world.spans_nodes["ep"][0]))
    merged = replace(p, **ops)
    if merged.saa is None and merged.ep_esp_alltoall is not None and merged.mp_allgather is not None:
        a2a, ag = merged.ep_esp_alltoall, merged.mp_allgather
        lay = world.layout
        ops["saa"] = AlphaBeta(max(a2a.alpha, ag.alpha), max(a2a.beta, ag.beta * lay.tensor / lay.expert_shard))
    return replace(p, name=name or f"{p.name} (flat ops for the simulated layout)", **ops)


def _even_alltoall(cluster: Cluster) -> AlphaBeta:
    """x input elements per rank of `ep_esp`, split evenly: the link carrying the larger share of the
    time at large x, its beta scaled to the fraction of x it carries."""
    world = cluster.world
    members = world.ep_esp_ranks(0)
    nodes = world.node[members]
    n = len(members)
    if n == 1:
        return AlphaBeta(0.0, 0.0)
    on = float(np.mean([(nodes == nodes[i]).sum() - 1 for i in range(n)])) / n
    off = float(np.mean([(nodes != nodes[i]).sum() for i in range(n)])) / n
    link = cluster.link("all_to_all")
    far = link.inter or link.intra
    candidates = [(link.intra.beta * on, link.intra.alpha)] if on > 0 else []
    candidates += [(far.beta * off, far.alpha)] if off > 0 else []
    beta, alpha = max(candidates)
    return AlphaBeta(alpha, beta)
