"""The simulator's driver: one model config on one cluster and layout, replaying a routing trace.

    sim = Simulation(cfg, profile, world_size=1024, workdir=tmp)
    result = sim.run(trace.steps())          # per iteration and MoE layer: time, breakdown, balance
    sim.layer_ops(counts)                    # one layer's ops (`ops.traffic_of`: its bytes per rank)
    sim.traffic                              # the last iteration's bytes per rank and counter key

Per iteration and micro-batch, per MoE layer in order: capacity drops on each data-parallel
micro-batch (the router's rule: expert e keeps min(count, C), C = ceil(f n k / E)); the schedule's
sources and counts; the balancers' placements from their own `plan` (one balancer per layer and
ep_esp group, as every rank of a group holds the same one; vExpert balancers share one slot table
per layer, as the all-reduced window makes every group decide alike); `observe` with the executed
placement's counts, as a training forward does; then the ops (`sim/moe_layer.py`,
`sim/replica_traffic.py`, `sim/model.py`) of each model chunk (`model/pipeline_stages.py`'s split; the
multi-token prediction depths after the last chunk's output layer, model/mtp.py) run
through timelines (`sim/timeline.py`) on their pipeline stage's ranks (`sim/layout.py`): with one
stage, each micro-batch's forward and backward on one timeline; with several, each chunk's
forward and backward of each micro-batch on its own, ordered by the training code's pipeline
programs (`sim/stages.py`). After the micro-batches: the vExperts' gradient sum, the gradient
sync, grad norm and loss sums (`sim/params.py`), and every `interval` iterations the vExperts'
`decide` on the window averaged over the groups, with the moves `vexpert_moves.MovesInFlight` would make:
at the end of the iteration (`moe.flexmoe.moves: sync`), or, best-effort, issued one layer's round
after the other on a side channel at the start of the next iteration and waited for right before
each layer's first forward (exposed: what the work before that forward does not hide).

The decisions come from the training code (`Balancer.plan` / `observe` / `SlotBalancer.decide`,
`techniques/parm/parm_model.py`'s Alg. 1), fed a flat profile derived from the cluster for this layout
(`sim/cluster.decision_profile`, stage 0's ranks); only time is modelled.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch

from megatron_moe.config.errors import ConfigError
from megatron_moe.config.schema import Config
from megatron_moe.config.validate import (GATED, expert_activation, expert_ffn_hidden_size, expert_proj_bias,
                                          validate_config)
from megatron_moe.distributed.parallel_state import ParallelState, RankLayout
from megatron_moe.model.pipeline_stages import StageChunks
from megatron_moe.model.transformer import moe_layer_flags, moe_layer_spacing
from megatron_moe.moe.balancers import BALANCERS
from megatron_moe.moe.vexpert_moves import plan_transfers
from megatron_moe.moe.vexperts import SlotTable
from megatron_moe.perf import timing
from megatron_moe.perf.hardware import ExpertShape, HardwareProfile, save_profile
from megatron_moe.techniques.lancet.lancet_partition_model import partition_max_range
from megatron_moe.sim.cluster import Cluster, decision_profile
from megatron_moe.sim.layout import WorldLayout
from megatron_moe.sim.model import DenseModel, lancet_forward, lancet_segments
from megatron_moe.sim.moe_layer import SCHEDULE_MODELS, LayerShape, ScheduleModel
from megatron_moe.sim.ops import Op, OpBuilder, Traffic, Widths
from megatron_moe.sim.params import StageParams, end_ops
from megatron_moe.sim.stages import Pipeline
from megatron_moe.sim.replica_traffic import replica_ops, vexpert_grad_op, vexpert_move_op
from megatron_moe.sim.results import IterationResult, LayerResult
from megatron_moe.sim.timeline import Timeline
from megatron_moe.sim.traces import RecordedTrace, SyntheticTrace, split_even
from megatron_moe.training.pipeline_schedules import expected_bubble

IDLE = 3.0  # breakdown kind of a stage's idle time in the pipeline (0 compute, 1 communication, 2 overlap)


def keep_capacity(counts: np.ndarray, capacity: Optional[int]) -> np.ndarray:
    """counts [..., E] of one micro-batch (before drops) -> kept: min(count, C) per expert."""
    return counts if capacity is None else np.minimum(counts, capacity)


def keep_pieces(pieces: np.ndarray, capacity: Optional[int]) -> np.ndarray:
    """S1's token pieces [dp, tp, E] before drops -> kept: piece t keeps what the capacity leaves
    after the pieces before it (drops go by token position over the whole micro-batch)."""
    if capacity is None:
        return pieces
    before = np.cumsum(pieces, axis=1) - pieces
    return np.clip(capacity - before, 0, pieces)


@dataclass
class Stage:
    """One pipeline stage: its ranks, the op builders on them, its model chunks and parameters."""

    world: WorldLayout
    b: OpBuilder
    model: ScheduleModel
    dense: DenseModel
    chunks: Tuple[range, ...]  # virtual chunk -> its global layer indices
    params: StageParams


@dataclass
class ChunkOps:
    """One micro-batch through one model chunk: forward sublayers (label, ops, is MoE), their
    backward (forward order), the embedding (first chunk) and output layer (last chunk) forward /
    backward, and the transfers issued at marks (handle, label, ops)."""

    sublayers: List[Tuple[str, List[Op], bool]] = field(default_factory=list)
    backward: List[Tuple[str, List[Op]]] = field(default_factory=list)
    embedding: Tuple[List[Op], List[Op]] = ([], [])
    head: Tuple[List[Op], List[Op]] = ([], [])
    registered: List[Tuple[str, str, List[Op]]] = field(default_factory=list)
    moves: List[Tuple[str, List[Op]]] = field(default_factory=list)  # best-effort rounds landing here (label, ops)
    mtp: List[Tuple[str, List[Op], bool]] = field(default_factory=list)  # the MTP depths' forward, after the head
    mtp_backward: List[Tuple[str, List[Op]]] = field(default_factory=list)

    def ops(self) -> List[Op]:
        """Every op once (Lancet's partitioned forward only retimes the sublayers)."""
        out = self.embedding[0] + self.embedding[1] + self.head[0] + self.head[1]
        out += [op for _, ops, _ in self.sublayers + self.mtp for op in ops]
        out += [op for _, ops in self.backward + self.mtp_backward for op in ops]
        return out + [op for _, _, ops in self.registered for op in ops]


def _add(sublayers: list, backward: list, label: str, ops: Tuple[List[Op], List[Op]]) -> None:
    """A non-MoE sublayer's (forward, backward) ops under `label`."""
    sublayers.append((label, ops[0], False))
    backward.append((label, ops[1]))


# `moe.token_dispatch` values the schedule models send: node_dedup's rows depend on which of a
# token's experts share a node, which a routing trace (counts per source and expert) does not hold
SIMULATED_TOKEN_DISPATCH = ("per_copy",)


class Simulation:
    def __init__(self, cfg: Config, profile: HardwareProfile, world_size: int, workdir: str):
        if cfg.moe.token_dispatch not in SIMULATED_TOKEN_DISPATCH:
            raise ConfigError(f"moe.token_dispatch={cfg.moe.token_dispatch}: the simulator models per_copy only (a "
                              "routing trace counts assignments per source and expert, not which share a node)")
        node_size = profile.cluster.node_size if profile.cluster else None
        cfg = replace(cfg, parallel=replace(cfg.parallel, ranks_per_node=node_size or cfg.parallel.ranks_per_node))
        validate_config(replace(cfg, perf=replace(cfg.perf, hardware_profile=None)), world_size)  # the layout first
        p = cfg.parallel
        self.layout = layout = RankLayout(world_size, p.tensor, p.pipeline, p.expert, p.expert_shard, p.ranks_per_node)
        worlds = [WorldLayout(layout, s) for s in range(p.pipeline)]
        clusters = [Cluster(profile, world) for world in worlds]
        flat = decision_profile(clusters[0])
        os.makedirs(workdir, exist_ok=True)
        path = os.path.join(workdir, "decision_profile.yaml")
        save_profile(flat, path)
        self.cfg = cfg = replace(cfg, perf=replace(cfg.perf, hardware_profile=path))
        validate_config(cfg, world_size)
        m, moe, tr = cfg.model, cfg.moe, cfg.training
        self.tokens = tr.micro_batch_size * m.seq_length
        self.micro_batches = tr.global_batch_size // (tr.micro_batch_size * layout.data_parallel)
        self.capacity = None if moe.capacity_factor is None else \
            math.ceil(moe.capacity_factor * self.tokens * moe.top_k / moe.num_experts)
        shape = ExpertShape(m.hidden_size, expert_ffn_hidden_size(cfg) // layout.expert_shard, expert_activation(cfg) in GATED)
        self.params_per_expert = shape.params(expert_proj_bias(cfg), layout.expert_shard)
        self.param_tensors = 4 if m.bias else 2
        self.shape = LayerShape(self.tokens, m.hidden_size, moe.top_k, moe.num_experts, shape.flops_per_row, moe.saa,
                                moe.smart_schedule, moe.smart_group_size)
        self.stages = []
        for s, (world, cluster) in enumerate(zip(worlds, clusters)):
            b = OpBuilder(world, cluster, Widths.of(tr.precision))
            self.stages.append(Stage(world, b, SCHEDULE_MODELS.get(moe.schedule)(b, self.shape, flat),
                                     DenseModel(cfg, b, self.tokens), StageChunks.of(cfg, s).layers,
                                     StageParams.of(cfg, layout, s)))
        self.pipeline = Pipeline(cfg, layout, clusters[0], self.micro_batches, Widths.of(tr.precision))
        self.moe_layers = [i for i, flag in enumerate(moe_layer_flags(cfg)) if flag]  # first_k_dense, layer_pattern
        self.moe_at = moe_at = {layer: i for i, layer in enumerate(self.moe_layers)}  # global layer -> MoE index
        self.mtp = [m.num_layers + k for k in range(m.mtp_depth)]  # model/mtp.py: on the last stage, after the head
        chunks = [(s, chunk) for s, stage in enumerate(self.stages) for chunk in stage.chunks]
        chunks += [(p.pipeline - 1, [layer]) for layer in self.mtp]  # each MTP layer runs alone
        self.stage_of = {moe_at[x]: s for s, chunk in chunks for x in chunk if x in moe_at}  # MoE layer index -> stage
        # MoE layers that start their chunk (and the MTP layers, each run alone): no block before them
        # prefetches their Trans (techniques/proprophet/cross_layer.py)
        self.first_in_chunk = {min(moe_at[x] for x in chunk if x in moe_at) for _, chunk in chunks
                               if any(x in moe_at for x in chunk)}
        groups = layout.expert_data_parallel
        state = ParallelState.build(layout, 0)
        self.planners = [[BALANCERS.get(moe.balancer)(cfg, state) for _ in range(groups)] for _ in self.moe_layers]
        for layer in self.planners:
            if layer[0].slots_per_rank is not None:  # vExperts: one slot table per layer, shared by the groups
                table = SlotTable.initial(moe.num_experts, layout.expert, layer[0].slots_per_rank, 0)
                for balancer in layer:
                    balancer.attach(SimpleNamespace(slot_table=table))
                layer[1:] = [layer[0]] * (groups - 1)
        self.traffic: Tuple[Dict[str, np.ndarray], Dict[str, np.ndarray]] = ({}, {})
        self.in_flight: Dict[int, List[Op]] = {}  # best-effort moves: MoE layer -> its round, issued next iteration
        self.landing: Dict[int, List[Op]] = {}  # the rounds this iteration's first forward of each layer waits for

    @property
    def vexperts(self) -> bool:
        return self.planners[0][0].slots_per_rank is not None

    # -- one layer ----------------------------------------------------------------------------------
    def plan_layer(self, index: int, counts: np.ndarray, pieces: Optional[np.ndarray] = None, observe: bool = True):
        """Counts [dp, E] of one micro-batch (before drops) of MoE layer `index` -> (Planned, ops,
        Trans ops, Agg ops, whether the block before prefetched Trans)."""
        stage = self.stages[self.stage_of[index]]
        kept = keep_capacity(counts, self.capacity)
        pieces = keep_pieces(split_even(counts, self.layout.tensor) if pieces is None else pieces, self.capacity)
        planners = self.planners[index]
        first = planners[0]
        prefetched = index not in self.first_in_chunk and first.prefetches_trans and \
            first.upcoming_replicas() is not None
        with timing.wall() as planning:  # host work
            planned = stage.model.plan(planners, kept, pieces)
            if observe:
                for planner, placement in zip(planners, planned.placements):  # (vExperts: one shared instance)
                    planner.observe(torch.from_numpy(placement.counts), planned.sources)
        plan_seconds = planning.seconds
        tag = str(index)
        ops = stage.model.layer(planned, tag)
        args = (self.params_per_expert, self.param_tensors)
        trans = replica_ops(stage.b, planned.placements, *args, f"trans{tag}", backward=False)
        agg = replica_ops(stage.b, planned.placements, *args, f"agg{tag}", backward=True)
        return planned, ops, trans, agg, prefetched, plan_seconds

    def _vexpert_grad(self, index: int) -> List[Op]:
        if not self.vexperts:
            return []
        return vexpert_grad_op(self.stages[self.stage_of[index]].b, self.planners[index][0].table.slots,
                               self.cfg.moe.num_experts, self.params_per_expert)

    def layer_ops(self, counts: np.ndarray, pieces: Optional[np.ndarray] = None, index: int = 0,
                  observe: bool = True) -> list:
        """Every op of one forward + backward of MoE layer `index` on counts [dp, E] (S1's token
        pieces [dp, tp, E] if known), Trans / Agg and the vExperts' gradient sum included: what
        `benchmarks/moe_layer.py` counts for one step (`ops.traffic_of` gives the bytes)."""
        planned, ops, trans, agg, _, _ = self.plan_layer(index, counts, pieces, observe)
        return ops.forward + ops.backward + trans + agg + self._vexpert_grad(index)

    def layer_seconds(self, counts: np.ndarray, pieces: Optional[np.ndarray] = None, index: int = 0) -> float:
        """Predicted forward + backward seconds of MoE layer `index` alone on counts [dp, E] (the
        slowest rank; no dense part, no gradient all-reduce): what `benchmarks/moe_layer.py` times."""
        planned, ops, trans, agg, _, _ = self.plan_layer(index, counts, pieces)
        timeline = Timeline(self.stages[self.stage_of[index]].world, self.cfg.moe.lancet.defer_wgrad)
        timeline.register(f"trans_issue{index}", "moe", trans)
        timeline.register(f"agg{index}", "moe", agg)
        timeline.run(ops.forward, "moe")
        timeline.run(ops.backward, "moe", backward=True)
        timeline.end_backward()
        timeline.run(self._vexpert_grad(index), "moe")
        return float(timeline.clock.max())

    # -- model chunks -------------------------------------------------------------------------------
    def chunk_ops(self, s: int, chunk: int, counts: np.ndarray, acc: dict) -> ChunkOps:
        """counts [L, dp, E] of one micro-batch through virtual chunk `chunk` of stage `s`: plans its
        MoE layers (in order) and builds every op; its bytes go to `acc`."""
        stage, out = self.stages[s], ChunkOps()
        dense = stage.dense
        if s == 0 and chunk == 0:
            out.embedding = dense.embedding()
        self._blocks(stage, stage.chunks[chunk], counts, acc, out, out.sublayers, out.backward)
        if s == self.layout.pipeline - 1 and chunk == len(stage.chunks) - 1:
            out.head = dense.head()
            for layer in self.mtp:  # model/mtp.py: per depth the lookup and eh_proj, one block, the head and loss
                _add(out.mtp, out.mtp_backward, f"mtp{layer}", dense.mtp_input())
                self._blocks(stage, [layer], counts, acc, out, out.mtp, out.mtp_backward)
                _add(out.mtp, out.mtp_backward, f"mtp{layer}", dense.head())
        self._count(acc, s, out.ops())
        return out

    def _blocks(self, stage: Stage, layers, counts: np.ndarray, acc: dict, out: ChunkOps, sublayers, backward) -> None:
        """Blocks `layers` (global indices) of one micro-batch: forward into `sublayers`, backward into
        `backward`; their balancers' transfers into `out`."""
        moe_at, dense = self.moe_at, stage.dense
        for layer in layers:
            _add(sublayers, backward, f"dense{layer}", dense.attention())
            if layer not in moe_at:
                _add(sublayers, backward, f"dense{layer}", dense.dense_ffn())
                continue
            i = moe_at[layer]
            planned, ops, trans, agg, prefetched, plan_s = self.plan_layer(i, counts[i])
            gate = dense.gate()
            label = f"moe{i}"
            landing = []  # `MoELayer.forward` -> `complete_moves`: the round lands before the layer plans
            if i in self.landing:
                out.moves.append((label, self.landing.pop(i)))
                landing = [stage.b.wait("vexpert_move", f"vexpert_move{i}")]
            sublayers.append((label, landing + gate[0] + ops.forward, True))
            backward.append((label, ops.backward + gate[1]))
            out.registered += [(f"before_experts{i - 1}" if prefetched else f"trans_issue{i}", label, trans),
                               (f"agg{i}", label, agg)]
            self._account(acc, i, planned, plan_s)

    def forward(self, timeline: Timeline, s: int, ops: ChunkOps) -> None:
        for handle, label, issued in ops.registered:
            timeline.register(handle, label, issued)
        timeline.issue_in_order(ops.moves)  # best-effort vExpert moves, in flight from the step before
        timeline.run(ops.embedding[0], "embedding")
        lancet = self.cfg.moe.lancet
        if lancet.partitions > 1:
            world = self.stages[s].world
            segments = lancet_segments(ops.sublayers, min(lancet.partitions, self.cfg.training.micro_batch_size),
                                       lancet.partition_range, world,
                                       partition_max_range(lancet.max_range, moe_layer_spacing(self.cfg)))
            forward = lancet_forward(ops.sublayers, segments, world)
        else:
            forward = [(label, sub) for label, sub, _ in ops.sublayers]
        for label, sub in forward:
            timeline.run(sub, label)
        timeline.run(ops.head[0], "head")
        for label, sub, _ in ops.mtp:
            timeline.run(sub, label)

    def backward(self, timeline: Timeline, ops: ChunkOps) -> None:
        for label, sub in reversed(ops.mtp_backward):
            timeline.run(sub, label, backward=True)
        timeline.run(ops.head[1], "head", backward=True)
        for label, sub in reversed(ops.backward):
            timeline.run(sub, label, backward=True)
        timeline.run(ops.embedding[1], "embedding", backward=True)
        timeline.end_backward()

    # -- iterations ---------------------------------------------------------------------------------
    def _account(self, acc: dict, i: int, planned, plan_s: float) -> None:
        layer = acc["layers"][i]
        for g, placement in enumerate(planned.placements):
            layer["rows"][g] += placement.per_rank
            layer["replicas"] += placement.num_replicas
            layer["forwards"] += 1
        for choice in planned.choice:
            layer["schedules"][choice] = layer["schedules"].get(choice, 0) + 1
        layer["plan_s"] += plan_s

    def _count(self, acc: dict, s: int, ops: List[Op], extra: Tuple[Traffic, ...] = ()) -> None:
        """Add the bytes of `ops` (and `extra`) on stage `s` to `acc`'s per-rank counters [world]."""
        size = self.layout.stage_size
        for t in [t for op in ops for t in op.traffic] + list(extra):
            for counter, values in ((acc["traffic"], t.counted), (acc["inter"], t.inter)):
                if values is not None:
                    counter.setdefault(t.key, np.zeros(self.layout.world_size))[s * size:(s + 1) * size] += values

    def _micro_batches(self, micro: np.ndarray, acc: dict, breakdowns: List[dict]):
        """Every micro-batch through every stage -> (when each stage's program ends, its compute
        seconds, the bubble). One stage: forward and backward of a micro-batch on one timeline."""
        defer = self.cfg.moe.lancet.defer_wgrad
        if len(self.stages) == 1:
            seconds = 0.0
            for m in range(self.micro_batches):
                timeline = Timeline(self.stages[0].world, defer)
                ops = self.chunk_ops(0, 0, micro[:, :, m], acc)
                self.forward(timeline, 0, ops)
                self.backward(timeline, ops)
                seconds += self._collect(timeline, breakdowns[0])
            return [seconds], [seconds], 0.0
        step = {}
        for m in range(self.micro_batches):
            for s, chunk in self.pipeline.chunks():
                ops = self.chunk_ops(s, chunk, micro[:, :, m], acc)
                for backward in (False, True):
                    timeline = Timeline(self.stages[s].world, defer)
                    if backward:
                        for handle, label, issued in ops.registered:
                            timeline.register(handle, label, issued)
                        self.backward(timeline, ops)
                    else:
                        self.forward(timeline, s, ops)
                    step[(s, backward, chunk, m)] = self._collect(timeline, breakdowns[s])
        for s in range(len(self.stages)):
            self._count(acc, s, [], (self.pipeline.traffic(s),))
        result = self.pipeline.run(step)
        return result.finish, result.busy, result.mean_bubble

    def iteration(self, iteration: int, counts: np.ndarray, micro: Optional[np.ndarray] = None) -> IterationResult:
        """counts [L, dp, E] of one iteration (before drops), micro [L, dp, M, E] if known."""
        L, lay = len(self.moe_layers), self.layout
        if counts.shape[0] != L or counts.shape[1] != lay.data_parallel:
            raise ValueError(f"iteration {iteration}: counts {counts.shape} do not match {L} MoE layers x "
                             f"{lay.data_parallel} data-parallel sources x E")
        micro = split_even(counts, self.micro_batches) if micro is None else micro  # [L, dp, M, E]
        acc = {"traffic": {}, "inter": {}, "layers": [
            {"rows": np.zeros((lay.expert_data_parallel, lay.expert)), "replicas": 0.0, "forwards": 0,
             "schedules": {}, "plan_s": 0.0} for _ in range(L)]}
        breakdowns = [{} for _ in self.stages]
        self.landing, self.in_flight = self.in_flight, {}
        finish, busy, bubble = self._micro_batches(micro, acc, breakdowns)
        # the end of the iteration, each stage from when its program ends
        items = [[op for i in range(L) if self.stage_of[i] == s for op in self._vexpert_grad(i)] +
                 end_ops(stage.b, stage.params, first_half=True) for s, stage in enumerate(self.stages)]
        step_ops, moves, transfers = self.after_step(iteration)
        items = [items[s] + end_ops(stage.b, stage.params, first_half=False) + step_ops[s]
                 for s, stage in enumerate(self.stages)]
        timelines = [Timeline(stage.world, start=finish[s]) for s, stage in enumerate(self.stages)]
        self.pipeline.run_stages(timelines, items, "iteration")
        for s in range(len(self.stages)):
            self._count(acc, s, items[s] + [op for i, ops in self.in_flight.items() if self.stage_of[i] == s
                                            for op in ops])  # best-effort moves: counted when issued
        critical = int(np.argmax([t.clock.max() for t in timelines]))
        breakdown = {key: list(value) for key, value in breakdowns[critical].items()}
        if len(self.stages) > 1:
            idle = finish[critical] - busy[critical]
            breakdown["pipeline/idle"] = [idle, idle, IDLE]
        seconds = float(timelines[critical].clock.max())
        self._collect(timelines[critical], breakdown)
        layers = []
        for i, layer in enumerate(acc["layers"]):
            parts = {key.split("/", 1)[1]: v for key, v in breakdowns[self.stage_of[i]].items()
                     if key.startswith(f"moe{i}/")}
            layers.append(LayerResult(sum(v[0] for v in parts.values()), parts, layer["rows"],
                                      layer["replicas"] / max(layer["forwards"], 1), layer["schedules"],
                                      layer["plan_s"]))
        by_kind: Dict[str, float] = {}
        for key, value in acc["traffic"].items():
            by_kind[key.split("/")[0]] = by_kind.get(key.split("/")[0], 0.0) + float(value.sum())
        self.traffic = (acc["traffic"], acc["inter"])
        par = self.cfg.parallel
        return IterationResult(iteration, seconds, breakdown, layers, by_kind, moves, transfers, bubble,
                               expected_bubble(par.pipeline, self.micro_batches, par.virtual_stages))

    def _collect(self, timeline: Timeline, breakdown: dict) -> float:
        """Add the critical rank's breakdown to `breakdown`; return its clock."""
        rank = timeline.critical_rank()
        for (label, name), (exposed, duration) in timeline.breakdown(rank).items():
            entry = breakdown.setdefault(f"{label}/{name}", [0.0, 0.0, float(timeline.comm.get((label, name), True))])
            entry[0] += exposed
            entry[1] += duration
        return float(timeline.clock[rank])

    def after_step(self, iteration: int, optimizer_state: bool = True) -> Tuple[List[List[Op]], int, int]:
        """`SlotBalancer.after_optimizer_step` of every layer without the collectives: when the
        balancer wants a decision (`wants_decision`), decide on the window (summed over the groups' forwards, / edp =
        their mean, the all-reduce "vexpert_plan/edp") and move (weights, and with
        `optimizer_state` both AdamW moments) -> (ops per pipeline stage, primitives executed,
        rank-to-rank transfers they take in one ep group).
        Best-effort moves (`SlotBalancer.moves`) go to `in_flight` instead, as issue ops on side
        channel `vexpert_move<i>`: the next iteration's first forward issues and waits for them."""
        ops, moves, transfers = [[] for _ in self.stages], 0, 0
        lay = self.layout
        bf16 = self.cfg.training.precision == "bf16"  # relocate: one buffer in the widest dtype it carries
        width = ((4 if bf16 else 3) if optimizer_state else 1) * self.params_per_expert
        element_bytes = 2 if bf16 and not optimizer_state else 4
        for i, layer in enumerate(self.planners):
            balancer, b = layer[0], self.stages[self.stage_of[i]].b
            if balancer.slots_per_rank is None:
                continue
            balancer.window_iterations += 1
            balancer.last_moves = 0
            if not balancer.wants_decision(iteration):
                continue
            ops[self.stage_of[i]].append(b.collective("vexpert_plan", "vexpert_plan", "edp",
                                                      lay.expert * self.cfg.moe.num_experts, 8, "all_reduce"))
            old = balancer.table.slots.copy()
            new = balancer.decide(balancer.window / lay.expert_data_parallel)
            transfers += 0 if new is None else len(plan_transfers(old, new))
            if new is not None:  # best-effort: the layer's next forward plans after its round landed, too
                best_effort = balancer.moves == "best_effort"
                move = vexpert_move_op(b, old, new, width, element_bytes, f"vexpert_move{i}" if best_effort else "")
                if best_effort:
                    self.in_flight[i] = move
                else:
                    ops[self.stage_of[i]] += move
                balancer.table.slots = balancer.table.checked(new)
            moves += balancer.last_moves
        return ops, moves, transfers

    def trace(self, spec: str, iterations: int, seed: int = 0):
        """The routing to replay: a `logging.routing_trace` directory, or a synthetic spec
        (uniform | zipf:S | drift:S:D, `sim/traces.py`), for this model and layout."""
        lay, cfg = self.layout, self.cfg
        rows = self.micro_batches * self.tokens * cfg.moe.top_k  # per data-parallel source and iteration
        if os.path.isdir(spec):
            return RecordedTrace(spec, lay.data_parallel, rows, cfg.moe.num_experts, last=None)
        return SyntheticTrace(spec, len(self.moe_layers), lay.data_parallel, cfg.moe.num_experts, rows, iterations, seed)

    def run(self, steps: Iterable, limit: Optional[int] = None, progress=None) -> List[IterationResult]:
        results = []
        for n, (iteration, counts, micro) in enumerate(steps):
            if limit is not None and n >= limit:
                break
            results.append(self.iteration(iteration, counts, micro))
            if progress is not None:
                progress(results[-1])
        return results


def simulate(config: Optional[str], overrides: List[str], profile: HardwareProfile, world_size: int, trace: str,
             iterations: int, workdir: str, seed: int = 0) -> List[IterationResult]:
    """One option: load the config with `overrides`, replay `trace` for `iterations`."""
    from megatron_moe.config import load_config

    sim = Simulation(load_config(config, overrides), profile, world_size, workdir)
    return sim.run(sim.trace(trace, iterations, seed).steps(), limit=iterations)
