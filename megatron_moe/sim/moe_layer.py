"""One simulated MoE layer for one micro-batch: the schedule's sources and counts, the balancers'
placements (their own `plan`, per `ep_esp` group), and every collective and computation of its
forward and backward as `Op`s (`sim/ops.py`), with the bytes `distributed/collectives.py` counts.

What each schedule issues, per rank (n: tokens of the micro-batch, h: hidden, k: top-k, E experts;
rows: kept assignments; a group of one rank issues nothing), in the order the layer issues it:

    baseline (moe/schedules/baseline.py, Parm Fig. 3(a)): ESP-AllGather of expert ids and
      combine weights ("all_gather_routing/esp"; the sizes are the config's) and of the tokens
      ("all_gather/esp"); counts on `ep`; EP-AlltoAll; experts; ESP-AllReduce; EP-AlltoAll back.
      Backward: the ESP-Split's all-gather, the two all-to-alls reversed, the tokens' reduce-scatter.
    s1 (Fig. 3(b)): counts on `tp` and the aux-loss sums' all-reduce, counts on `ep_esp`,
      EP&ESP-AlltoAll (each row to every shard holder of its EP rank), experts, back, MP-AllGather
      of the outputs. Backward: the all-to-alls reversed, the router weight's all-reduce and the
      MP-Split's all-gather on `tp`.
    s2 (Fig. 3(c)): counts on `ep_esp`, EP&ESP-AlltoAll of this TP rank's chunk of every expert,
      experts, back (AAS: all-to-all then MP-AllGather; SAA: phased point to point with the
      all-gathers overlapped, after one exchange of the TP peers' splits where a TP group spans
      ep_esp groups); backward the same.
    auto: both candidates' counts on `ep_esp`, Alg. 1's pick (`techniques/parm/parm_model.py`, the max over
      `tp` when a TP group spans ep_esp groups), then S1's or S2's exchange (S1 split after the gate).
    smart (FasterMoE §4.2, `moe.smart_schedule`): the exchange, experts and exchange back as
      pipelined pairwise steps ("smart_p2p"), forward and backward.

Sources (`Placement` rows): baseline, the `ep` ranks after the ESP-AllGather (the summed
micro-batches of their ESP group); s1, each ep_esp rank's token piece (exact when the trace gives
pieces, else each expert's kept rows dealt evenly over the TP ranks); s2, each ep_esp rank's chunk
of every expert (exact: the chunks depend only on the counts). Replicas: `sim/replica_traffic.py`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Tuple

import numpy as np
import torch

from megatron_moe.moe.balancers.base import OwnerOnly
from megatron_moe.moe.placement import Placement, owned_experts
from megatron_moe.techniques.parm.parm_model import choose_schedule, dispatched_assignments
from megatron_moe.config.registry import Registry
from megatron_moe.sim.ops import Op, OpBuilder, Traffic, profile_elements
from megatron_moe.sim.traces import split_even

SCHEDULE_MODELS = Registry("moe.schedule")


@dataclass
class LayerShape:
    """What the ops of one MoE layer depend on besides the counts."""

    tokens: int  # n: tokens of one data-parallel micro-batch
    hidden: int
    top_k: int
    num_experts: int
    flops_per_row: float  # one row through one expert shard, forward
    saa: bool
    smart: bool
    smart_group_size: int


@dataclass
class Executed:
    """What the simulator reads from one group's `Placement`."""

    rows: np.ndarray  # [S, ep] rows source s sends EP rank q (routing_table summed over experts)
    per_rank: np.ndarray  # [ep] rows each EP rank computes (`tokens_per_ep_rank`)
    counts: np.ndarray  # [S, E] the sources' counts it deals out (what `observe` gets)
    replicas: Tuple[Tuple[int, ...], ...]  # `transient_replicas()`: what Trans moves
    num_replicas: int

    @classmethod
    def of(cls, placement: Placement) -> "Executed":
        counts, rows = (t.numpy() for t in placement.source_rows())
        return cls(rows, rows.sum(0), counts, placement.transient_replicas(), placement.num_replicas)

    @classmethod
    def owner_only(cls, counts: np.ndarray, ep: int) -> "Executed":
        """`of(Placement.owner_only(counts, ep))` without its dense [S, E, ep] table (tested equal)."""
        num_experts = counts.shape[1]
        rows = counts.reshape(counts.shape[0], ep, num_experts // ep).sum(2)
        owners = tuple((q,) for q in range(ep) for _ in owned_experts(q, num_experts, ep))
        return cls(rows, rows.sum(0), counts, owners, 0)


@dataclass
class Planned:
    """The placements of one layer and micro-batch, one per ep_esp group, and what ran."""

    placements: List[Executed]
    choice: List[str]  # per group: "baseline" | "s1" | "s2"
    sources: List[int]  # source_ep_ranks of the executed schedule
    candidates: dict = field(default_factory=dict)  # auto: {"s1": placements, "s2": placements}


@dataclass
class LayerOps:
    forward: List[Op] = field(default_factory=list)  # a wait on "trans" marks where the experts need Trans
    backward: List[Op] = field(default_factory=list)  # an issue of "agg" follows the experts' backward


# -- sources ----------------------------------------------------------------------------------------
def _groups(world, per_rank: np.ndarray) -> List[np.ndarray]:
    """[W, E] counts per rank -> per ep_esp group [ep * esp, E] (sources = the group's ranks)."""
    n = world.group_size["ep_esp"]
    return [per_rank[g * n:(g + 1) * n] for g in range(world.size // n)]


def baseline_sources(world, kept: np.ndarray) -> List[np.ndarray]:
    """Per group [ep, E]: EP rank p's G_p, the micro-batches of its ESP group summed."""
    lay = world.layout
    return [c.reshape(lay.expert, lay.expert_shard, -1).sum(1) for c in _groups(world, kept[world.coord["dp"]])]


def s1_sources(world, pieces: np.ndarray) -> List[np.ndarray]:
    """pieces [dp, tp, E]: kept assignments of each TP rank's token piece."""
    return _groups(world, pieces[world.coord["dp"], world.coord["tp"]])


def s2_sources(world, kept: np.ndarray) -> List[np.ndarray]:
    chunks = split_even(kept, world.layout.tensor)  # [dp, tp, E]: S2's MP-Split after the gate
    return _groups(world, chunks[world.coord["dp"], world.coord["tp"]])


def plan_all(planners, counts: List[np.ndarray], sources: List[int]) -> List[Executed]:
    """Each group's balancer plans its counts (`Balancer.plan`, the training code). The owner-only
    policy ("none") is read without building its dense table: at 1024 ranks that table is most of
    the simulation time."""
    ep = max(sources) + 1
    return [Executed.owner_only(c, ep) if type(planner) is OwnerOnly
            else Executed.of(planner.plan(torch.from_numpy(np.ascontiguousarray(c)), sources))
            for planner, c in zip(planners, counts)]


# -- what the placements send -----------------------------------------------------------------------
def ep_exchange(world, placements: List[Executed]) -> np.ndarray:
    """Baseline: [ep groups, ep, ep] rows from EP rank p to q (every ESP rank of p sends G_p's)."""
    return np.stack([p.rows for p in placements for _ in range(world.layout.expert_shard)]).astype(np.float64)


def ep_esp_exchange(world, placements: List[Executed]) -> np.ndarray:
    """Parm: [groups, n, n] rows from source s to (q, j'): T[s, q] for every shard holder j'."""
    return np.stack([np.repeat(p.rows, world.layout.expert_shard, axis=1) for p in placements]).astype(np.float64)


def computed_rows(world, placements: List[Executed]) -> np.ndarray:
    """[W]: rows every rank computes (each ESP shard of an EP rank computes all its rows)."""
    esp = world.layout.expert_shard
    return np.concatenate([np.repeat(p.per_rank, esp) for p in placements]).astype(np.float64)


def tp_sum(world, per_rank: np.ndarray) -> np.ndarray:
    """[W] -> [W]: the sum of `per_rank` over each rank's tp group."""
    gid = world.group_id["tp"]
    sums = np.zeros(int(gid.max()) + 1)
    np.add.at(sums, gid, per_rank)
    return sums[gid]


# -- FasterMoE's smart schedule ---------------------------------------------------------------------
def smart_pipeline(send: np.ndarray, compute: np.ndarray, back: np.ndarray) -> np.ndarray:
    """techniques/fastermoe/smart.py's order on one compute and one communication channel, per rank:
    post S_0; for step j: wait S_j, post S_{j+1}, C_j, post R_j. send / compute / back [steps, W]."""
    steps = send.shape[0]
    comm_free, host = send[0].copy(), np.zeros_like(send[0])
    arrived = [send[0]]
    for j in range(steps):
        host = np.maximum(host, arrived[j])
        if j + 1 < steps:
            comm_free = np.maximum(host, comm_free) + send[j + 1]
            arrived.append(comm_free)
        host = host + compute[j]
        comm_free = np.maximum(host, comm_free) + back[j]
    return np.maximum(host, comm_free)


def smart_op(b: OpBuilder, elements: np.ndarray, group: str, flops_per_element: float, backward: bool,
             peer_group: int) -> Op:
    """The pairwise exchange of `elements` [G, n, n] over `group` in fine-grained groups of
    `peer_group` members: step j sends to group (i - j) mod steps and computes the rows of group
    (i + j) mod steps. Backward mirrors it with twice the compute. Bytes: "smart_p2p", what a rank
    sends to other ranks both ways (its own rows are a local copy)."""
    world, cluster = b.world, b.cluster
    members = b.members(group)
    n = members.shape[1]
    steps, fine = n // peer_group, np.arange(n) // peer_group
    x = np.asarray(elements, dtype=np.float64)
    send, comp = np.zeros((steps, world.size)), np.zeros((steps, world.size))
    for j in range(steps):
        to = fine[None, :] == (fine[:, None] - j) % steps  # [n(i), n(m)]: m in i's destination group
        frm = fine[None, :] == (fine[:, None] + j) % steps  # m in the group i receives from
        _, sent_on, sent_off, _, _ = b.split(group, x * to[None])
        _, _, _, recv_on, recv_off = b.split(group, x * frm.T[None])
        send[j] = cluster.exchange("p2p", profile_elements(np.maximum(sent_on, recv_on), b.widths.activation),
                                   profile_elements(np.maximum(sent_off, recv_off), b.widths.activation))
        rows = b.zeros()
        rows[members] = (x * frm.T[None]).sum(1)
        comp[j] = cluster.compute(rows * flops_per_element * (2 if backward else 1))
    _, on, off, recv_on, recv_off = b.split(group, x)
    act = b.widths.activation
    counted = (on + off + recv_on + recv_off) * act
    mirrored = smart_pipeline(send, comp, send)  # R_j moves what S_j moved, the other way
    # a rank sends its rows (S) and the outputs of the rows it received (R) to other ranks
    return Op("smart", "sync", lambda k: mirrored / k, group,
              [Traffic(f"smart_p2p/{group}", counted, (off + recv_off) * act)], a2a=True)


def issue_trans(b: OpBuilder, tag: str, dispatch: Op = None) -> List[Op]:
    """Where a layer's replicas move (`Schedule.run`, moe/replicas.py): *Trans* issued before the
    dispatch ("trans_issue<tag>", unless the block before prefetched it), the next layer's prefetch
    right before the experts ("before_experts<tag>", Pro-Prophet Alg. 2 line 7), Trans waited
    before the experts. The smart schedule waits for it before its first step."""
    ops = [b.mark(f"trans_issue{tag}")] + ([dispatch] if dispatch is not None else [])
    return ops + [b.mark(f"before_experts{tag}"), b.wait("trans", f"trans{tag}")]


# -- the schedules ----------------------------------------------------------------------------------
class ScheduleModel:
    """What a schedule sends, given the placements its balancer planned."""

    def __init__(self, b: OpBuilder, shape: LayerShape, decision_profile=None):
        self.b, self.shape, self.world = b, shape, b.world
        self.lay, self.profile = b.world.layout, decision_profile

    def plan(self, planners, kept: np.ndarray, pieces: np.ndarray) -> Planned:
        raise NotImplementedError

    def layer(self, planned: Planned, tag: str) -> LayerOps:
        raise NotImplementedError

    def _meta(self, name, kind, group, elements, element_bytes=8, cost="all_gather") -> Op:
        return self.b.collective(name, kind, group, elements, element_bytes, cost)

    def _rows(self, name, kind, group, rows, cost, calls=1) -> Op:
        return self.b.collective(name, kind, group, np.asarray(rows, dtype=np.float64) * self.shape.hidden,
                                 self.b.widths.activation, cost, calls=calls)

    def _experts(self, rows: np.ndarray, backward: bool) -> Op:
        flops = rows * self.shape.flops_per_row * (2 if backward else 1)
        return self.b.compute("experts", flops, deferrable=0.5 if backward else 0.0)

    def _exchange(self, name, matrix, group, kind="all_to_all") -> Op:
        return self.b.exchange(name, kind, group, matrix * self.shape.hidden, self.b.widths.activation, a2a=True)

    def _smart(self, matrix, group, backward, peer_group) -> Op:
        return smart_op(self.b, matrix * self.shape.hidden, group, self.shape.flops_per_row / self.shape.hidden,
                        backward, peer_group)


@SCHEDULE_MODELS.register("baseline")
class BaselineModel(ScheduleModel):
    def plan(self, planners, kept, pieces) -> Planned:
        sources = list(range(self.lay.expert))
        placements = plan_all(planners, baseline_sources(self.world, kept), sources)
        return Planned(placements, ["baseline"] * len(placements), sources)

    def layer(self, planned: Planned, tag: str) -> LayerOps:
        s, lay, b = self.shape, self.lay, self.b
        esp = lay.expert_shard > 1
        n_gathered = s.tokens * lay.expert_shard
        T = ep_exchange(self.world, planned.placements)  # [ep groups, ep, ep]
        rows = computed_rows(self.world, planned.placements)
        out = LayerOps()
        f, bw = out.forward, out.backward
        if esp:
            f += [self._meta("routing", "all_gather_routing", "esp", s.top_k * n_gathered),
                  self._meta("routing", "all_gather_routing", "esp", s.top_k * n_gathered, 4),
                  self._rows("esp_allgather", "all_gather", "esp", n_gathered, "all_gather")]
            bw.append(self._rows("esp_split", "all_gather", "esp", n_gathered, "all_gather"))
        if lay.expert > 1:
            f.append(self._meta("counts", "all_gather_counts", "ep", s.num_experts * lay.expert))
        if s.smart:
            steps = lay.expert // s.smart_group_size
            f += issue_trans(b, tag) + [self._smart(T, "ep", False, s.smart_group_size)]
            if esp:  # each step's partial sums are ESP-AllReduced before they go back
                f.append(self._rows("esp_allreduce", "all_reduce", "esp", rows, "all_reduce", calls=steps))
            bw += [self._smart(T, "ep", True, s.smart_group_size), b.mark(f"agg{tag}")]
        else:
            f += issue_trans(b, tag, dispatch=self._exchange("dispatch", T, "ep")) + [self._experts(rows, False)]
            if esp:
                f.append(self._rows("esp_allreduce", "all_reduce", "esp", rows, "all_reduce"))
            f.append(self._exchange("combine", T.transpose(0, 2, 1), "ep"))
            bw += [self._exchange("combine", T, "ep"), self._experts(rows, True), b.mark(f"agg{tag}"),
                   self._exchange("dispatch", T.transpose(0, 2, 1), "ep")]
        if esp:
            bw.append(self._rows("esp_allgather", "reduce_scatter", "esp", n_gathered, "all_gather"))
        return out


class ParmModel(ScheduleModel):
    """S1, S2 and auto: the EP&ESP exchange and each candidate's MP collectives."""

    def _candidate(self, choice: str, placements: List[Executed], tag: str) -> LayerOps:
        s, lay, b = self.shape, self.lay, self.b
        M = ep_esp_exchange(self.world, placements)  # [groups, n, n]
        rows = computed_rows(self.world, placements)
        own = np.zeros(self.world.size)
        own[b.members("ep_esp")] = M.sum(2) / lay.expert_shard  # rows each source holds (before the Dump)
        m_all = tp_sum(self.world, own)  # S2: the micro-batch's kept assignments (its TP pieces' rows)
        tp, s2 = lay.tensor > 1, choice == "s2"
        out = LayerOps()
        f, bw = out.forward, out.backward
        agg = b.mark(f"agg{tag}")
        if s.smart:
            peer = s.smart_group_size * lay.expert_shard
            f += issue_trans(b, tag) + [self._smart(M, "ep_esp", False, peer)]
            bw += [self._smart(M, "ep_esp", True, peer), agg]
            if s2 and tp:  # S2's MP-AllGather after the steps, and the MP-Split's backward
                f.append(self._rows("mp_allgather", "all_gather", "tp", m_all, "all_gather"))
                bw.append(self._rows("mp_split", "all_gather", "tp", m_all, "all_gather"))
            return out
        saa = s.saa and s2
        f += issue_trans(b, tag, dispatch=self._exchange("dispatch", M, "ep_esp")) + [self._experts(rows, False)]
        bw += [self._exchange("combine", M, "ep_esp"), self._experts(rows, True), agg]
        if saa:
            if tp and (lay.expert * lay.expert_shard) % lay.tensor:  # the TP peers' splits and send orders,
                # once per forward, where a TP group spans ep_esp groups (else its own placement has them)
                f.insert(0, self._meta("routing", "all_gather_routing", "tp", lay.tensor * lay.expert + m_all))
            f.append(self._saa("combine", M, m_all))
            bw.append(self._saa("dispatch", M, m_all))
            return out
        f.append(self._exchange("combine", M.transpose(0, 2, 1), "ep_esp"))
        bw.append(self._exchange("dispatch", M.transpose(0, 2, 1), "ep_esp"))
        if s2 and tp:
            f.append(self._rows("mp_allgather", "all_gather", "tp", m_all, "all_gather"))
            bw.append(self._rows("mp_allgather", "all_gather", "tp", m_all, "all_gather"))
        return out

    def _saa(self, name: str, M: np.ndarray, m_all: np.ndarray) -> Op:
        """SAA (§III-D): N_EP phases of point-to-point exchange on ep_esp, each phase's combined rows
        all-gathered on tp while the next phase runs. Timed by the profile's measured `saa` (Parm's
        Overlap(x), x = this rank's all-to-all input) when it has one, else by the phases on the
        links; counts the phased exchange (own slice not sent) and the gathers."""
        s, lay, b = self.shape, self.lay, self.b
        back = M.transpose(0, 2, 1) * s.hidden
        act = b.widths.activation
        p2p = b.exchange(name, "all_to_all_p2p", "ep_esp", back, act, counts_own=False, cost_kind="p2p", a2a=True)
        gather = b.collective(name, "all_gather", "tp", m_all * s.hidden, act, "all_gather", calls=lay.expert)
        x = profile_elements(b.split("ep_esp", back)[0], act)
        measured, phases = b.cluster.saa, lay.expert

        def cost(k):
            if measured is not None:
                return np.where(x > 0, measured.alpha + measured.beta * x / k, 0.0)
            step, ag = p2p.cost(k) / phases, gather.cost(k) / phases  # even phases
            return step + (phases - 1) * np.maximum(step, ag) + ag

        return p2p.joined(gather, cost)

    def _s1_extras(self, f: List[Op], bw: List[Op], routed_here: bool) -> None:
        """S1's MP-AllGather of the outputs; the gate's TP collectives (S1 proper) or the
        MP-Split-after-the-gate's backward (auto's S1)."""
        s, lay = self.shape, self.lay
        if lay.tensor == 1:
            return
        n = s.tokens
        f.append(self._rows("mp_allgather", "all_gather", "tp", n, "all_gather"))
        if routed_here:
            f[:0] = [self._meta("counts", "all_gather_counts", "tp", s.num_experts * lay.tensor),
                     self._meta("aux_loss", "all_reduce", "tp", s.num_experts + 1, 4, "all_reduce")]
            bw.append(self._meta("router_grad", "all_reduce", "tp", s.num_experts * s.hidden, 4, "all_reduce"))
        else:
            bw.append(self._meta("mp_split", "all_gather", "tp", s.top_k * n, 4))
        bw.append(self._rows("mp_split", "all_gather", "tp", n, "all_gather"))

    def _counts(self, per_source: int) -> Op:
        return self._meta("counts", "all_gather_counts", "ep_esp", per_source * self.lay.expert * self.lay.expert_shard)

    def _sources(self) -> List[int]:
        """source_ep_ranks of S1 / S2: every ep_esp rank, on its EP rank."""
        return [s // self.lay.expert_shard for s in range(self.lay.expert * self.lay.expert_shard)]


class PauseMPModel(ParmModel):
    """S1 or S2 alone (`choice`): plan its sources' counts, its exchange, its MP collectives."""

    choice = ""

    def plan(self, planners, kept, pieces) -> Planned:
        counts = s1_sources(self.world, pieces) if self.choice == "s1" else s2_sources(self.world, kept)
        placements = plan_all(planners, counts, self._sources())
        return Planned(placements, [self.choice] * len(placements), self._sources())

    def layer(self, planned: Planned, tag: str) -> LayerOps:
        out = self._candidate(self.choice, planned.placements, tag)
        out.forward.insert(0, self._counts(self.shape.num_experts))
        if self.choice == "s1":
            self._s1_extras(out.forward, out.backward, routed_here=True)
        return out


@SCHEDULE_MODELS.register("s1")
class S1Model(PauseMPModel):
    choice = "s1"


@SCHEDULE_MODELS.register("s2")
class S2Model(PauseMPModel):
    choice = "s2"


@SCHEDULE_MODELS.register("auto")
class AutoModel(ParmModel):
    """Parm Alg. 1 per group (`Auto._choose`): plan both candidates, pick by `choose_schedule`."""

    def plan(self, planners, kept, pieces) -> Planned:
        lay, sources = self.lay, self._sources()
        candidates = {"s1": plan_all(planners, s1_sources(self.world, pieces), sources),
                      "s2": plan_all(planners, s2_sources(self.world, kept), sources)}
        assignments = np.array([[dispatched_assignments(torch.from_numpy(p.per_rank), lay.tensor, lay.expert_shard)
                                 for p in candidates[c]] for c in ("s1", "s2")])  # [2, groups]
        span = lay.tensor // (lay.expert * lay.expert_shard)
        if span > 1:  # a TP group spans `span` ep_esp groups: their estimates are max-reduced over tp
            assignments = assignments.reshape(2, -1, span).max(2).repeat(span, axis=1)
        choice = [choose_schedule(self.profile, self.shape.tokens, self.shape.hidden, float(a1), lay.tensor,
                                  lay.expert_shard, self.shape.saa, assignments_s2=float(a2))
                  for a1, a2 in assignments.T]
        placements = [candidates[c][g] for g, c in enumerate(choice)]
        return Planned(placements, choice, sources, candidates)

    def layer(self, planned: Planned, tag: str) -> LayerOps:
        lay, out = self.lay, LayerOps()
        out.forward.append(self._counts(2 * self.shape.num_experts))
        if lay.tensor > lay.expert * lay.expert_shard:
            out.forward.append(self._meta("auto_choice", "auto_choice", "tp", 2, 8, "all_reduce"))
        per_rank = np.repeat(np.array(planned.choice), lay.expert * lay.expert_shard)
        for choice in ("s2", "s1"):
            keep = per_rank == choice
            if not keep.any():
                continue
            ops = self._candidate(choice, [planned.candidates[choice][g] for g in range(len(planned.choice))], tag)
            if choice == "s1":
                self._s1_extras(ops.forward, ops.backward, routed_here=False)
            out.forward += [op.masked(keep) for op in ops.forward]
            out.backward += [op.masked(keep) for op in ops.backward]
        return out
