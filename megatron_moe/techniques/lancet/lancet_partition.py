"""Lancet's partitioned forward (Jiang et al., MLSys'24, §5), in eager PyTorch
(`moe.lancet.partitions: k`, `moe.lancet.partition_range: auto | N`).

Lancet splits the micro-batch along the batch dimension into k parts and pipelines the non-MoE
computation around an MoE layer with that layer's all-to-alls: while part q's tokens travel,
another part's attention (or the layers after the MoE layer) computes. Lancet does it as an IR
pass; here `ForwardPartitioner.run` replaces the model's layer loop. The forward is a sequence of
sublayer instructions (`attention` and `ffn` of every layer); a *segment* of them around one MoE
FFN runs as k parts (techniques/lancet/lancet_partition_model.py has the cost model and the range selection):

    A_0                                  A = the segment's sublayers before the MoE FFN, and its norm
    for q in 0..k-1:                     MoE FFN of part q (moe/layer.py), with
        MoE_q  [A_{q+1} while its dispatch all-to-all is in flight,
                B_{q-1} while its combine all-to-all is in flight]
    B_{k-1}                              B = the residual add and the sublayers after the MoE FFN

What keeps it exact (every option here must give the unpartitioned run's numbers):

* the gate routes part q with the whole micro-batch's capacity and the per-expert counts of the
  parts before it (`router.GatePartition`, Lancet §5 "capacity information between partitions"):
  drops are the unpartitioned batch's; the aux and z losses are computed once from every part's
  sums. Any part may send 0..C tokens to an expert: the all-to-alls are the schedules' all-to-all-v
  (irregular, no padding; Lancet Fig. 10's sizes-then-data exchange is the placement's counts);
* attention and every non-MoE op act per sequence, so batch parts compute the same rows;
* dropout masks are slices of the whole micro-batch's masks (`DropoutRNG.batch_parts`);
* every rank runs the same deterministic order of collectives (the order above does not depend on
  timing), and autograd's backward over the parts' graphs is the same on every rank.

Every schedule (baseline, s1, s2, SAA, auto, the smart schedule) and balancer runs per part: a
balancer plans, and replicas are fetched, for each part. A batch-level gate cannot be partitioned
before the MoE layer (Lancet §5: the topology gate's budget ranks the whole batch), so
`moe.gate: topology` is refused with partitions > 1.

`partition_range: N` takes up to N sublayers before and after every MoE FFN (0: the MoE FFN alone).
`auto` measures every sublayer once, on the first forward, at 1..k parts (forward only, no
dropout, nothing recorded), takes the maximum over the ranks of the pipeline stage, and runs §5.1's
dynamic program over segments of at most `moe.lancet.max_range` sublayers (the paper's iota;
default 2 x the layers from one MoE FFN to the next, `moe_layer_spacing`: 2 x `moe.layer_freq`). With pipeline stages each model chunk has
its own partitioner over its layers.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch

from megatron_moe.distributed import collectives as C
from megatron_moe.moe.router import GatePartition
from megatron_moe.moe.schedules import A2A_KINDS
from megatron_moe.moe.schedules.base import even_split
from megatron_moe.moe.stats import MoEStats
from megatron_moe.perf import timing
from megatron_moe.techniques.lancet.lancet_partition_model import (Instruction, MoECost, Segment, best_partitioning,
                                                fixed_partitioning, partition_max_range, segment_time)
from megatron_moe.config.errors import ConfigError
from megatron_moe.config.validate import section_check
from megatron_moe.model.pipeline_stages import STAGE_HOOKS
from megatron_moe.model.transformer import moe_layer_spacing

PLAN_KIND = "lancet_plan"  # byte-counter label of the all-reduce of measured op times (auto)


def op_names(layers) -> List[str]:
    """The forward's instructions: 'attention <i>' and 'ffn <i>' / 'moe <i>' per layer (global
    layer index i), in order."""
    return [name for layer in layers
            for name in (f"attention {layer.layer_index}", f"{'moe' if layer.is_moe else 'ffn'} {layer.layer_index}")]


def _run_op(layers, op: int, x: torch.Tensor, padding_mask, aux_losses: Optional[list] = None) -> torch.Tensor:
    """Sublayer `op` (2 i: layer i's attention, 2 i + 1: its FFN) on x [b, s, h]."""
    layer = layers[op // 2]
    if op % 2 == 0:
        return layer.attention_sublayer(x, padding_mask)
    x, aux = layer.ffn_sublayer(x)
    if aux is not None and aux_losses is not None:
        aux_losses.append(aux)
    return x


class ForwardPartitioner:
    """Runs a model's layers with Lancet's partitioned segments (module docstring)."""

    def __init__(self, state, rng, layers, max_parts: int, partition_range: str, max_range: Optional[int] = None):
        """`max_range`: auto's longest segment in sublayers (§5.1's iota; None = no limit)."""
        self.state, self.rng, self.max_parts, self.max_range = state, rng, max_parts, max_range
        is_moe = [op % 2 == 1 and layers[op // 2].is_moe for op in range(2 * len(layers))]
        self.segments: Optional[List[Segment]] = None if partition_range == "auto" else fixed_partitioning(
            is_moe, max_parts, int(partition_range))  # auto: planned on the first forward
        self.prediction: Optional[dict] = None  # auto: the dynamic program's predicted seconds

    # -- the forward ------------------------------------------------------------------------------
    def run(self, layers, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """x [b, s, h] through every layer -> (x, sum of the MoE aux losses), as `run_layers`."""
        if self.segments is None:
            self.segments = self.plan(layers, x, padding_mask)
        aux_losses: list = []
        op = 0
        for segment in self.segments:
            for plain in range(op, segment.start):
                x = _run_op(layers, plain, x, padding_mask, aux_losses)
            x = self._pipelined(layers, segment, x, padding_mask, aux_losses)
            op = segment.end
        for plain in range(op, 2 * len(layers)):
            x = _run_op(layers, plain, x, padding_mask, aux_losses)
        aux = torch.stack(aux_losses).sum() if aux_losses else torch.zeros((), device=x.device)
        return x, aux

    def _pipelined(self, layers, segment: Segment, x: torch.Tensor, padding_mask, aux_losses: list) -> torch.Tensor:
        parts = min(segment.parts, x.shape[0])
        sizes = even_split(x.shape[0], parts)
        xs = list(x.split(sizes))  # [b_q, s, h] per part
        masks = list(padding_mask.split(sizes)) if padding_mask is not None else [None] * parts
        owner = layers[segment.moe // 2]
        moe = owner.ffn
        gate = GatePartition(x.shape[0] * x.shape[1])
        draws = self.rng.batch_parts(sizes)
        normed: List[Optional[torch.Tensor]] = [None] * parts  # MoE input of each part
        outputs: List[Optional[torch.Tensor]] = [None] * parts

        def before(q: int) -> None:  # A_q
            with draws.part(q):
                for op in range(segment.start, segment.moe):
                    xs[q] = _run_op(layers, op, xs[q], masks[q])
                normed[q] = owner.ffn_norm(xs[q])

        def after(q: int) -> None:  # B_q
            with draws.part(q):
                xs[q] = xs[q] + owner.residual_dropout(outputs[q])
                for op in range(segment.moe + 1, segment.end):
                    xs[q] = _run_op(layers, op, xs[q], masks[q])

        grad_enabled = torch.is_grad_enabled()

        def call(fn: Callable[[int], None], q: int) -> Optional[Callable[[], None]]:
            """fn(q) as an in-flight callback: the all-to-alls call it inside their autograd
            Function's forward, where autograd is off, so it restores the forward's grad mode."""
            def run() -> None:
                with torch.set_grad_enabled(grad_enabled):
                    fn(q)
            return run if 0 <= q < parts else None

        stats = []
        moe.router.partition = gate
        try:
            before(0)
            for q in range(parts):
                moe.part_index = q
                with draws.part(q):
                    outputs[q], _ = moe(normed[q], while_dispatching=call(before, q + 1),
                                        while_combining=call(after, q - 1))
                stats.append(moe.last_stats)
            after(parts - 1)
        finally:
            moe.router.partition, moe.part_index = None, None
        moe.last_stats = MoEStats.merge(stats)
        aux_losses.append(gate.aux_loss(moe.router))
        return torch.cat(xs)

    # -- auto: measure, then §5.1's dynamic program -----------------------------------------------
    def plan(self, layers, x: torch.Tensor, padding_mask) -> List[Segment]:
        """`partition_range: auto`: the segments of §5.1's dynamic program over measured op times."""
        instructions = self.measure(layers, x, padding_mask)
        predicted, segments = best_partitioning(instructions, min(self.max_parts, x.shape[0]), self.max_range)
        plain = segment_time(instructions, 0, len(instructions), 1)
        self.prediction = dict(plain_forward_s=plain, partitioned_forward_s=predicted,
                               segments=[(s.start, s.end, s.parts) for s in segments])
        if self.state.rank == 0:
            names = op_names(layers)
            chosen = ", ".join(f"[{names[s.start]} .. {names[s.end - 1]}] x{s.parts}" for s in segments) or "none"
            print(f"lancet: partitioned forward segments (auto): {chosen}; predicted forward "
                  f"{predicted * 1e3:.1f} ms vs {plain * 1e3:.1f} ms unpartitioned", flush=True)
        return segments

    def measure(self, layers, x: torch.Tensor, padding_mask, repeats: int = 2) -> List[Instruction]:
        """Every sublayer's forward time for one of k parts (k = 1..max), MoE FFNs split into
        compute and all-to-all; the maximum over the pipeline stage's ranks (its dp x tp grid), so
        every rank that runs these layers plans the same segments.
        Runs without autograd and dropout, and leaves the communication counters as they were."""
        max_parts = min(self.max_parts, x.shape[0])
        names = op_names(layers)
        times = torch.zeros(len(names), max_parts, 2, dtype=torch.float64)  # [op, k-1, (compute, a2a)]
        training = [layer.training for layer in layers]
        for layer in layers:
            layer.eval()
        try:
            with torch.no_grad(), C.COMM_STATS.unrecorded():
                for k in range(1, max_parts + 1):
                    rows = even_split(x.shape[0], k)[0]
                    h = x[:rows]
                    mask = padding_mask[:rows] if padding_mask is not None else None
                    for op in range(len(names)):
                        best = None
                        for _ in range(repeats):
                            before = C.COMM_STATS.seconds_by_phase(A2A_KINDS)["total"]["forward"]
                            with timing.wall(x.device) as took:  # measurement mode: synchronized
                                out = _run_op(layers, op, h, mask)
                            seconds = took.seconds
                            a2a = C.COMM_STATS.seconds_by_phase(A2A_KINDS)["total"]["forward"] - before
                            if best is None or seconds < best[0] + best[1]:
                                best = (max(seconds - a2a, 0.0), a2a)
                        times[op, k - 1] = torch.tensor(best, dtype=torch.float64)
                        h = out
                # the maximum over the pipeline stage's ranks (its dp x tp grid; NCCL: on the GPU), so
                # every rank that runs these layers plans the same segments
                times = times.to(x.device)
                for group in (self.state.tp, self.state.dp):
                    C.all_reduce(times, group, op="max", kind=PLAN_KIND)
                times = times.cpu()
        finally:
            for layer, was_training in zip(layers, training):
                layer.train(was_training)
        instructions = []
        for op, name in enumerate(names):
            per_k = {k: float(times[op, k - 1, 0]) for k in range(1, max_parts + 1)}
            if name.startswith("moe"):
                half = {k: float(times[op, k - 1, 1]) / 2 for k in range(1, max_parts + 1)}  # dispatch, combine
                instructions.append(Instruction(name, per_k, {k: MoECost(per_k[k], half[k], half[k]) for k in per_k}))
            else:
                instructions.append(Instruction(name, {k: per_k[k] + float(times[op, k - 1, 1]) for k in per_k}))
        return instructions


@STAGE_HOOKS.register("moe.lancet.partitions")
def from_config(cfg, state, rng, layers) -> Optional[ForwardPartitioner]:
    """The model's partitioner when `moe.lancet.partitions` > 1, else None."""
    lancet = cfg.moe.lancet
    if lancet.partitions <= 1 or not any(layer.is_moe for layer in layers):
        return None
    return ForwardPartitioner(state, rng, layers, lancet.partitions, str(lancet.partition_range),
                              partition_max_range(lancet.max_range, moe_layer_spacing(cfg)))


@section_check("moe.lancet.partitions")
def _check_lancet_partitions(cfg, world_size: int) -> None:
    """`moe.lancet.partitions` / `partition_range`."""
    lancet = cfg.moe.lancet
    if lancet.partitions < 1:
        raise ConfigError(f"moe.lancet.partitions={lancet.partitions} must be >= 1 (1 = off)")
    if lancet.partitions > cfg.training.micro_batch_size:
        raise ConfigError(f"moe.lancet.partitions={lancet.partitions} must be <= training.micro_batch_size="
                          f"{cfg.training.micro_batch_size}: each part is at least one sequence")
    rng = str(lancet.partition_range)
    if rng != "auto" and not (rng.isdigit()):
        raise ConfigError(f"moe.lancet.partition_range={rng!r} must be auto or a number of sublayers >= 0")
    if lancet.max_range is not None and (lancet.max_range < 1 or rng != "auto"):
        raise ConfigError(f"moe.lancet.max_range={lancet.max_range} must be >= 1 (or null) and needs "
                          f"moe.lancet.partition_range=auto (got {rng!r}): it bounds the dynamic program's segments")
    if lancet.partitions > 1 and cfg.training.recompute != "none":
        raise ConfigError(f"moe.lancet.partitions>1 and training.recompute={cfg.training.recompute} cannot be "
                          "combined yet: the partitioned forward runs sublayers per batch part, outside the "
                          "recomputed regions and their dropout replay")
    if lancet.partitions > 1 and cfg.moe.gate == "topology":
        raise ConfigError("moe.lancet.partitions>1 and moe.gate=topology cannot be combined: the topology gate's "
                          "budget ranks the whole micro-batch's choices, so batch parts would route differently "
                          "(Lancet §5: such gates allow partitioning only after the MoE layer, not built)")
