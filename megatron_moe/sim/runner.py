"""The simulator's driver: one model config on one cluster and layout, replaying a routing trace.

    sim = Simulation(cfg, profile, world_size=1024, workdir=tmp)
    result = sim.run(trace.steps())          # per iteration and MoE layer: time, breakdown, balance
    sim.layer_traffic(counts)                # one layer's bytes per rank and counter key (tests)

Per iteration and micro-batch, per MoE layer in order: capacity drops on each data-parallel
micro-batch (the router's rule: expert e keeps min(count, C), C = ceil(f n k / E)); the schedule's
sources and counts; the balancers' placements from their own `plan` (one balancer per layer and
ep_esp group, as every rank of a group holds the same one; vExpert balancers share one slot table
per layer, as the all-reduced window makes every group decide alike); `observe` with the executed
placement's counts, as a training forward does; then the ops (`sim/moe_layer.py`,
`sim/replicas.py`, `sim/model.py`) run through the timeline (`sim/timeline.py`). After the
micro-batches: the gradient all-reduces, vExperts' gradient sum, and every `interval` iterations
their `decide` on the window averaged over the groups, with the moves `relocate` would make.

The decisions come from the training code (`Balancer.plan` / `observe` / `SlotBalancer.decide`,
`perf/parm_model.py`'s Alg. 1), fed a flat profile derived from the cluster for this layout
(`sim/cluster.decision_profile`); only time is modelled.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Dict, Iterable, List, Optional

import numpy as np
import torch

from megatron_moe.config.schema import Config
from megatron_moe.config.validate import expert_ffn_hidden_size, validate_config
from megatron_moe.distributed.parallel_state import ParallelState, RankLayout
from megatron_moe.moe.balancers import BALANCERS
from megatron_moe.moe.vexperts import SlotTable
from megatron_moe.perf.calibrate import ExpertShape
from megatron_moe.perf.hardware import HardwareProfile, save_profile
from megatron_moe.sim.cluster import Cluster, decision_profile
from megatron_moe.sim.layout import WorldLayout
from megatron_moe.sim.model import DenseModel, lancet_forward, lancet_segments
from megatron_moe.sim.moe_layer import SCHEDULE_MODELS, LayerShape
from megatron_moe.sim.ops import OpBuilder, traffic_of
from megatron_moe.sim.replicas import replica_ops, vexpert_grad_op, vexpert_move_op
from megatron_moe.sim.timeline import Timeline
from megatron_moe.sim.traces import RecordedTrace, SyntheticTrace, split_even


def moe_layer_indices(cfg: Config) -> List[int]:
    f = cfg.moe.layer_freq
    return [i for i in range(cfg.model.num_layers) if i % f == f - 1]


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
class LayerResult:
    seconds: float  # exposed time of the layer's ops on the critical rank, summed over micro-batches
    breakdown: Dict[str, List[float]]  # op -> [exposed, duration] seconds, communication (1) or not (0)
    rows_per_group: np.ndarray  # [ep_esp groups, ep] rows computed per EP rank, summed over micro-batches
    replicas: float  # mean replicas per forward and group
    schedules: Dict[str, int] = field(default_factory=dict)  # executed schedule -> (group, micro-batch) count
    plan_seconds: float = 0.0  # wall time the real planners took here (measured, not modelled)

    @property
    def rows_per_ep_rank(self) -> np.ndarray:
        """[ep] rows computed per EP rank, summed over the ep_esp groups (benchmarks/moe_layer.py's)."""
        return self.rows_per_group.sum(0)

    @property
    def balance_ratio(self) -> float:
        load = self.rows_per_ep_rank
        return float(load.max() / load.mean()) if load.mean() > 0 else 1.0

    @property
    def balance_degree(self) -> float:
        """Pro-Prophet's balance degree: the standard deviation of the rows per device."""
        return float(np.std(self.rows_per_ep_rank))


@dataclass
class IterationResult:
    iteration: int
    seconds: float
    # "<label>/<op>" -> [exposed, duration, communication (1) or computation (0)] on the critical rank
    breakdown: Dict[str, List[float]]
    layers: List[LayerResult]
    bytes_by_kind: Dict[str, float]  # summed over ranks
    vexpert_moves: int = 0


class Simulation:
    def __init__(self, cfg: Config, profile: HardwareProfile, world_size: int, workdir: str):
        node_size = profile.cluster.node_size if profile.cluster else None
        cfg = replace(cfg, parallel=replace(cfg.parallel, ranks_per_node=node_size or cfg.parallel.ranks_per_node))
        validate_config(replace(cfg, perf=replace(cfg.perf, hardware_profile=None)), world_size)  # the layout first
        p = cfg.parallel
        layout = RankLayout(world_size, p.tensor, p.pipeline, p.expert, p.expert_shard, p.ranks_per_node)
        self.world = WorldLayout(layout)
        self.cluster = Cluster(profile, self.world)
        flat = decision_profile(self.cluster)
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
        shape = ExpertShape(m.hidden_size, expert_ffn_hidden_size(cfg) // layout.expert_shard, m.activation == "swiglu")
        self.params_per_expert = shape.params(m.bias, layout.expert_shard)
        self.param_tensors = 4 if m.bias else 2
        self.b = OpBuilder(self.world, self.cluster)
        self.shape = LayerShape(self.tokens, m.hidden_size, moe.top_k, moe.num_experts, shape.flops_per_row, moe.saa,
                                moe.smart_schedule, moe.smart_group_size)
        self.model = SCHEDULE_MODELS.get(moe.schedule)(self.b, self.shape, flat)
        self.dense = DenseModel(cfg, self.b, self.tokens)
        self.moe_layers = moe_layer_indices(cfg)
        groups = layout.expert_data_parallel
        state = ParallelState.build(layout, 0)
        self.planners = [[BALANCERS.get(moe.balancer)(cfg, state) for _ in range(groups)] for _ in self.moe_layers]
        for layer in self.planners:
            if layer[0].slots_per_rank is not None:  # vExperts: one slot table per layer, shared by the groups
                table = SlotTable.initial(moe.num_experts, layout.expert, layer[0].slots_per_rank, 0)
                for balancer in layer:
                    balancer.attach(SimpleNamespace(slot_table=table))
                layer[1:] = [layer[0]] * (groups - 1)
        self.iterations_done = 0

    @property
    def vexperts(self) -> bool:
        return self.planners[0][0].slots_per_rank is not None

    # -- one layer ----------------------------------------------------------------------------------
    def plan_layer(self, index: int, counts: np.ndarray, pieces: Optional[np.ndarray] = None, observe: bool = True):
        """Counts [dp, E] of one micro-batch (before drops) of MoE layer `index` -> (Planned, ops,
        Trans ops, Agg ops, whether the block before prefetched Trans)."""
        lay = self.world.layout
        kept = keep_capacity(counts, self.capacity)
        pieces = keep_pieces(split_even(counts, lay.tensor) if pieces is None else pieces, self.capacity)
        planners = self.planners[index]
        first = planners[0]
        prefetched = index > 0 and first.prefetches_trans and first.upcoming_replicas() is not None
        start = time.perf_counter()
        planned = self.model.plan(planners, kept, pieces)
        if observe:
            for planner, placement in zip(planners, planned.placements):  # (vExperts: one shared instance)
                planner.observe(torch.from_numpy(placement.counts), planned.sources)
        plan_seconds = time.perf_counter() - start
        tag = str(index)
        ops = self.model.layer(planned, tag)
        args = (self.params_per_expert, self.param_tensors)
        trans = replica_ops(self.b, planned.placements, *args, f"trans{tag}", backward=False)
        agg = replica_ops(self.b, planned.placements, *args, f"agg{tag}", backward=True)
        return planned, ops, trans, agg, prefetched, plan_seconds

    def layer_ops(self, counts: np.ndarray, pieces: Optional[np.ndarray] = None, index: int = 0,
                  observe: bool = True) -> list:
        """Every op of one forward + backward of MoE layer `index` on counts [dp, E] (S1's token
        pieces [dp, tp, E] if known), Trans / Agg and the vExperts' gradient sum included: what
        `benchmarks/moe_layer.py` counts for one step (`ops.traffic_of` gives the bytes)."""
        planned, ops, trans, agg, _, _ = self.plan_layer(index, counts, pieces, observe)
        out = ops.forward + ops.backward + trans + agg
        if self.vexperts:
            out += vexpert_grad_op(self.b, self.planners[index][0].table.slots, self.cfg.moe.num_experts,
                                   self.params_per_expert)
        return out

    def layer_seconds(self, counts: np.ndarray, pieces: Optional[np.ndarray] = None, index: int = 0) -> float:
        """Predicted forward + backward seconds of MoE layer `index` alone on counts [dp, E] (the
        slowest rank; no dense part, no gradient all-reduce): what `benchmarks/moe_layer.py` times."""
        planned, ops, trans, agg, _, _ = self.plan_layer(index, counts, pieces)
        timeline = Timeline(self.world, self.cfg.moe.lancet.defer_wgrad)
        timeline.register(f"trans_issue{index}", "moe", trans)
        timeline.register(f"agg{index}", "moe", agg)
        timeline.run(ops.forward, "moe")
        timeline.run(ops.backward, "moe", backward=True)
        timeline.end_backward()
        if self.vexperts:
            timeline.run(vexpert_grad_op(self.b, self.planners[index][0].table.slots, self.cfg.moe.num_experts,
                                         self.params_per_expert), "moe")
        return float(timeline.clock.max())

    # -- iterations ---------------------------------------------------------------------------------
    def micro_batch(self, counts: np.ndarray, timeline: Timeline, acc: dict) -> None:
        """counts [L, dp, E] of one micro-batch through forward and backward (ops on `timeline`)."""
        cfg, dense = self.cfg, self.dense
        moe_at = {layer: i for i, layer in enumerate(self.moe_layers)}
        sublayers, backward = [], []
        for layer in range(cfg.model.num_layers):
            attention = dense.attention()
            sublayers.append((f"dense{layer}", attention[0], False))
            backward.append((f"dense{layer}", attention[1]))
            if layer not in moe_at:
                ffn = dense.dense_ffn()
                sublayers.append((f"dense{layer}", ffn[0], False))
                backward.append((f"dense{layer}", ffn[1]))
                continue
            i = moe_at[layer]
            planned, ops, trans, agg, prefetched, plan_s = self.plan_layer(i, counts[i])
            gate = dense.gate()
            label = f"moe{i}"
            sublayers.append((label, gate[0] + ops.forward, True))
            backward.append((label, ops.backward + gate[1]))
            issue_at = f"before_experts{i - 1}" if prefetched else f"trans_issue{i}"
            timeline.register(issue_at, label, trans)
            timeline.register(f"agg{i}", label, agg)
            self._account(acc, i, planned, plan_s)
            for key, value in traffic_of(ops.forward + ops.backward + trans + agg).items():
                acc["bytes"][key] = acc["bytes"].get(key, 0.0) + float(value.sum())
        lancet = cfg.moe.lancet
        if lancet.partitions > 1:
            segments = lancet_segments(sublayers, min(lancet.partitions, cfg.training.micro_batch_size),
                                       lancet.partition_range, self.world)
            forward = lancet_forward(sublayers, segments, self.world)
        else:
            forward = [(label, ops) for label, ops, _ in sublayers]
        for label, ops in forward:
            timeline.run(ops, label)
        head = dense.head()
        timeline.run(head[0] + head[1], "head", backward=True)
        for label, ops in reversed(backward):
            timeline.run(ops, label, backward=True)
        timeline.end_backward()

    def _account(self, acc: dict, i: int, planned, plan_s: float) -> None:
        layer = acc["layers"][i]
        for g, placement in enumerate(planned.placements):
            layer["rows"][g] += placement.per_rank
            layer["replicas"] += placement.num_replicas
            layer["forwards"] += 1
        for choice in planned.choice:
            layer["schedules"][choice] = layer["schedules"].get(choice, 0) + 1
        layer["plan_s"] += plan_s

    def iteration(self, iteration: int, counts: np.ndarray, micro: Optional[np.ndarray] = None) -> IterationResult:
        """counts [L, dp, E] of one iteration (before drops), micro [L, dp, M, E] if known."""
        L, lay = len(self.moe_layers), self.world.layout
        if counts.shape[0] != L or counts.shape[1] != lay.data_parallel:
            raise ValueError(f"iteration {iteration}: counts {counts.shape} do not match {L} MoE layers x "
                             f"{lay.data_parallel} data-parallel sources x E")
        micro = split_even(counts, self.micro_batches) if micro is None else micro  # [L, dp, M, E]
        acc = {"bytes": {}, "layers": [{"rows": np.zeros((lay.expert_data_parallel, lay.expert)), "replicas": 0.0,
                                        "forwards": 0,
                                        "schedules": {}, "plan_s": 0.0} for _ in range(L)]}
        seconds, breakdown = 0.0, {}
        for m in range(self.micro_batches):
            timeline = Timeline(self.world, self.cfg.moe.lancet.defer_wgrad)
            self.micro_batch(micro[:, :, m], timeline, acc)
            seconds += self._collect(timeline, breakdown)
        timeline = Timeline(self.world)
        end_ops = self.dense.grad_sync(L, self._expert_params_per_rank())
        for i in range(L):
            if self.vexperts:
                end_ops += vexpert_grad_op(self.b, self.planners[i][0].table.slots, self.cfg.moe.num_experts,
                                           self.params_per_expert)
        step_ops, moves = self.after_step(iteration)
        end_ops += step_ops
        timeline.run(end_ops, "iteration")
        seconds += self._collect(timeline, breakdown)
        for op in end_ops:
            for key, value in traffic_of([op]).items():
                acc["bytes"][key] = acc["bytes"].get(key, 0.0) + float(value.sum())
        layers = []
        for i, layer in enumerate(acc["layers"]):
            parts = {key.split("/", 1)[1]: v for key, v in breakdown.items() if key.startswith(f"moe{i}/")}
            layers.append(LayerResult(sum(v[0] for v in parts.values()), parts, layer["rows"],
                                      layer["replicas"] / max(layer["forwards"], 1), layer["schedules"],
                                      layer["plan_s"]))
        by_kind: Dict[str, float] = {}
        for key, value in acc["bytes"].items():
            by_kind[key.split("/")[0]] = by_kind.get(key.split("/")[0], 0.0) + value
        self.iterations_done += 1
        return IterationResult(iteration, seconds, breakdown, layers, by_kind, moves)

    def _collect(self, timeline: Timeline, breakdown: dict) -> float:
        rank = timeline.critical_rank()
        for (label, name), (exposed, duration) in timeline.breakdown(rank).items():
            entry = breakdown.setdefault(f"{label}/{name}", [0.0, 0.0, float(timeline.comm.get((label, name), True))])
            entry[0] += exposed
            entry[1] += duration
        return float(timeline.clock[rank])

    def _expert_params_per_rank(self) -> float:
        slots = self.planners[0][0].slots_per_rank or self.cfg.moe.num_experts // self.world.layout.expert
        return float(slots * self.params_per_expert * len(self.moe_layers))

    def after_step(self, iteration: int, optimizer_state: bool = True):
        """`SlotBalancer.after_optimizer_step` of every layer without the collectives: every
        `interval` iterations, decide on the window (summed over the groups' forwards, / edp =
        their mean, the all-reduce "vexpert_plan/edp") and move (weights, and with
        `optimizer_state` both AdamW moments) -> (ops, primitives executed)."""
        ops, moves = [], 0
        lay = self.world.layout
        width = (3 if optimizer_state else 1) * self.params_per_expert
        for layer in self.planners:
            balancer = layer[0]
            if balancer.slots_per_rank is None:
                continue
            balancer.window_iterations += 1
            balancer.last_moves = 0
            if iteration % balancer.interval:
                continue
            ops.append(self.b.collective("vexpert_plan", "vexpert_plan", "edp", lay.expert * self.cfg.moe.num_experts,
                                         8, "all_reduce"))
            old = balancer.table.slots.copy()
            new = balancer.decide(balancer.window / lay.expert_data_parallel)
            if new is not None:
                ops += vexpert_move_op(self.b, old, new, width)
                balancer.table.slots = balancer.table.checked(new)
            moves += balancer.last_moves
        return ops, moves

    def trace(self, spec: str, iterations: int, seed: int = 0):
        """The routing to replay: a `logging.routing_trace` directory, or a synthetic spec
        (uniform | zipf:S | drift:S:D, `sim/traces.py`), for this model and layout."""
        lay, cfg = self.world.layout, self.cfg
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
