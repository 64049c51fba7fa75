"""The rest of a simulated micro-batch around the MoE layers: each block's dense computation and
tensor-parallel all-reduces, the embedding (first model chunk), the output layer and loss (last
model chunk), and Lancet's partitioned forward (§5), built as `Op`s from the model config (GPT).

Per token and rank (n tokens, h hidden, s sequence, f dense FFN width, V vocabulary, tp = N_MP),
forward FLOPs (backward: twice; its weight-gradient half is what Lancet may defer):

    attention  2 (h (a + 2 G) d + a d h) / tp + 2 (2 s a d) / tp   (QKV and output projections; scores
               and mix; a heads of width d, G query groups: 2 (4 h^2) / tp + 2 (2 s h) / tp for MHA);
               MLA (`attention_shape`): q_up (or q), kv_up, the output projection and the cores / tp,
               q_down and kv_down whole on every rank. Every score counts: causal masks and sliding
               windows (`model.sliding_window`) mask scores the cores still compute (SDPA with a dense mask)
    MTP depth  2 (2 h h) / tp (eh_proj) + a block + the head again        (`model.mtp_depth`, last stage)
    dense FFN  2 (2 h f) / tp, SwiGLU 2 (3 h f) / tp
    gate       2 h E
    head       2 h V / tp                           (the output layer)

Tensor-parallel collectives (kind "all_reduce/tp"; [n, h] in the activations' width, bf16 or fp32):
every attention / dense FFN sublayer one all-reduce of [n, h] forward and one backward (MLA
backward: of [n, q_lora_rank or h], [n, kv_lora_rank] and [n, qk_rope_head_dim] instead); the
vocab-parallel embedding one of [n, h] forward (and each MTP depth's lookup; its eh_proj an all-gather
of [n, h] forward, an all-reduce of [n, 2 h] backward); the vocab-parallel cross-entropy three of [n] (max,
sum of exponentials, target logit; fp32) forward and the output layer's input one of [n, h] backward. The embedding lookup's time and the gradient
sync after the micro-batches (`sim/params.py`) are not here.

Lancet's partitioned forward (`moe.lancet.partitions` k > 1): the sublayers become §5's
instructions with their simulated times at 1..k parts (the slowest rank's), `best_partitioning`
(`techniques/lancet/lancet_partition_model.py`, the dynamic program training runs on measured times) picks the
segments, and each segment's forward runs as `pipeline_time` per rank: a computation op with the
parts' compute, and a communication op with what the pipeline leaves exposed.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

from megatron_moe.model.attention import head_dim, query_groups
from megatron_moe.techniques.lancet.lancet_partition_model import (Instruction, MoECost, Segment, best_partitioning, fixed_partitioning,
                                                 pipeline_time)
from megatron_moe.sim.ops import Op, OpBuilder


class DenseModel:
    def __init__(self, cfg, b: OpBuilder, tokens: int):
        self.cfg, self.b, self.tokens = cfg, b, tokens
        m, lay = cfg.model, b.world.layout
        h, s, tp = m.hidden_size, m.seq_length, lay.tensor
        sharded, replicated, core, self.attention_grads = attention_shape(m, tp)
        self.attention_flops = 2 * (sharded + core) / tp + 2 * replicated
        self.attention_weight_share = (sharded / tp + replicated) / ((sharded + core) / tp + replicated)
        self.ffn_flops = 2 * (3 if m.activation == "swiglu" else 2) * h * m.ffn_hidden_size / tp
        self.head_flops = 2 * h * m.vocab_size / tp
        self.gate_flops = 2 * h * cfg.moe.num_experts

    def _sublayer(self, name: str, flops_per_token: float, weight_share: float,
                  grads: Tuple[int, ...] = ()) -> Tuple[List[Op], List[Op]]:
        """`grads`: the widths of the input gradients all-reduced over tp backward ([n, h] when none given)."""
        b, n, h = self.b, self.tokens, self.cfg.model.hidden_size
        fwd = [b.compute(name, flops_per_token * n, dense=True)]
        bwd = [b.compute(name, 2 * flops_per_token * n, dense=True, deferrable=0.5 * weight_share)]
        act = b.widths.activation
        fwd += self._tp_allreduce(f"{name}_tp_allreduce", n * h, act)
        bwd[:0] = [op for width in grads or (h,) for op in self._tp_allreduce(f"{name}_tp_allreduce", n * width, act)]
        return fwd, bwd

    def attention(self) -> Tuple[List[Op], List[Op]]:
        return self._sublayer("attention", self.attention_flops, self.attention_weight_share, self.attention_grads)

    def dense_ffn(self) -> Tuple[List[Op], List[Op]]:
        return self._sublayer("dense_ffn", self.ffn_flops, 1.0)

    def mtp_input(self) -> Tuple[List[Op], List[Op]]:
        """One MTP depth's input (model/mtp.py): the word lookup's all-reduce of [n, h] and eh_proj [h, 2h]
        (column-parallel, its output all-gathered: [n, h]) forward; eh_proj's input gradient [n, 2h] backward."""
        b, n, h = self.b, self.tokens, self.cfg.model.hidden_size
        flops, act = 2 * 2 * h * h / b.world.layout.tensor, b.widths.activation
        gather = [b.collective("eh_proj_tp_allgather", "all_gather", "tp", n * h, act, "all_gather")] \
            if b.world.layout.tensor > 1 else []
        return self.embedding()[0] + [b.compute("eh_proj", flops * n, dense=True)] + gather, \
            [b.compute("eh_proj", 2 * flops * n, dense=True, deferrable=0.5)] + \
            self._tp_allreduce("eh_proj_tp_allreduce", n * 2 * h, act)

    def gate(self) -> Tuple[List[Op], List[Op]]:
        b, n = self.b, self.tokens
        return [b.compute("gate", self.gate_flops * n, dense=True)], \
            [b.compute("gate", 2 * self.gate_flops * n, dense=True, deferrable=0.5)]

    def _tp_allreduce(self, name: str, elements: int, element_bytes: int = 4) -> List[Op]:
        tp = self.b.world.layout.tensor > 1
        return [self.b.collective(name, "all_reduce", "tp", elements, element_bytes, "all_reduce")] if tp else []

    def embedding(self) -> Tuple[List[Op], List[Op]]:
        """The vocab-parallel lookup's all-reduce (forward; its backward is local)."""
        return self._tp_allreduce("embedding_tp_allreduce", self.tokens * self.cfg.model.hidden_size,
                                  self.b.widths.activation), []

    def head(self) -> Tuple[List[Op], List[Op]]:
        b, n = self.b, self.tokens
        loss = [op for _ in range(3) for op in self._tp_allreduce("loss_tp_allreduce", n)]
        return [b.compute("head", self.head_flops * n, dense=True)] + loss, \
            [b.compute("head", 2 * self.head_flops * n, dense=True, deferrable=0.5)] + \
            self._tp_allreduce("head_tp_allreduce", n * self.cfg.model.hidden_size, self.b.widths.activation)


def attention_shape(m, tp: int) -> Tuple[float, float, float, Tuple[int, ...]]:
    """Per token of one attention sublayer: (multiply-adds of the weights split over tp, of the
    weights replicated on every tp rank, of the scores and mix over all heads; the widths of the
    input gradients all-reduced over tp backward). Standard (MHA / GQA): QKV and output projections,
    one [n, h] gradient. MLA (model/mla.py): q_down, kv_down replicated; q_up (or q), kv_up, proj split
    by heads; the gradients of q_up's (q's) and kv_up's inputs and of the shared rotary key k^R.
    Sliding windows and causal masks do not shrink the scores: the cores compute all s x s, masked."""
    h, s, heads = m.hidden_size, m.seq_length, m.num_attention_heads
    if m.attention != "mla":
        d, groups = head_dim(m), query_groups(m)
        return h * (heads + 2 * groups) * d + heads * d * h, 0.0, 2 * s * heads * d, (h,)
    qr, kr, qk, v = m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    sharded = (qr or h) * heads * qk + kr * heads * (m.qk_nope_head_dim + v) + heads * v * h
    replicated = (h * qr if qr else 0) + h * (kr + m.qk_rope_head_dim)
    return sharded, replicated, s * heads * (qk + v), (qr or h, kr, m.qk_rope_head_dim)


# -- Lancet's partitioned forward ----------------------------------------------------------------------
def _slowest(ops: List[Op], parts: int, world) -> np.ndarray:
    """[W] seconds of `ops` run in a row at 1 / parts of their size, each collective its group's slowest."""
    total = np.zeros(world.size)
    for op in ops:
        if op.mode in ("compute", "sync"):
            t = op.seconds(parts)
            total += world.group_max(op.group, t) if op.mode == "sync" and op.group else t
    return total


def _moe_parts(ops: List[Op]) -> Tuple[List[Op], List[Op], List[Op]]:
    """An MoE layer's forward ops split at its expert computation: (dispatch side, compute, combine side)."""
    index = next(i for i, op in enumerate(ops) if op.mode == "compute" and op.name == "experts")
    before = [op for op in ops[:index] if op.mode != "compute"]
    compute = [op for op in ops if op.mode == "compute"]
    after = [op for op in ops[index + 1:] if op.mode != "compute"]
    return before, compute, after


def lancet_segments(sublayers: List[Tuple[str, List[Op], bool]], max_parts: int, partition_range: str,
                    world, max_range: Optional[int] = None) -> List[Segment]:
    """`moe.lancet.partition_range`: auto, §5.1's dynamic program over the simulated instruction
    times (`best_partitioning`, segments of at most `max_range` sublayers); N, every MoE FFN with N
    sublayers before and after it (`fixed_partitioning`), as `techniques/lancet/lancet_partition.py` decides on
    measured times."""
    if str(partition_range) != "auto":
        return fixed_partitioning([is_moe for _, _, is_moe in sublayers], max_parts, int(partition_range))
    instructions = []
    for label, ops, is_moe in sublayers:
        times = {k: float(_slowest(ops, k, world).max()) for k in range(1, max_parts + 1)}
        moe = None
        if is_moe:
            before, compute, after = _moe_parts(ops)
            moe = {k: MoECost(float(_slowest(compute, k, world).max()), float(_slowest(before, k, world).max()),
                              float(_slowest(after, k, world).max())) for k in range(1, max_parts + 1)}
        instructions.append(Instruction(label, times, moe))
    return best_partitioning(instructions, max_parts, max_range)[1]


def lancet_forward(sublayers: List[Tuple[str, List[Op], bool]], segments: List[Segment],
                   world) -> List[Tuple[str, List[Op]]]:
    """sublayers [(label, forward ops, is MoE)] -> [(label, ops)] with each segment's ops replaced
    by its pipeline (module docstring)."""
    out: List[Tuple[str, List[Op]]] = []
    start = 0
    for seg in segments:
        out += [(label, ops) for label, ops, _ in sublayers[start:seg.start]]
        k = seg.parts
        before = sum((_slowest(ops, k, world) for _, ops, _ in sublayers[seg.start:seg.moe]), np.zeros(world.size))
        after = sum((_slowest(ops, k, world) for _, ops, _ in sublayers[seg.moe + 1:seg.end]), np.zeros(world.size))
        label, ops, _ = sublayers[seg.moe]
        d_ops, c_ops, x_ops = _moe_parts(ops)
        cost = MoECost(_slowest(c_ops, k, world), _slowest(d_ops, k, world), _slowest(x_ops, k, world))
        span = pipeline_time(k, before, cost, after)
        busy = k * (before + after + cost.compute)  # computation, all of it on the clock
        comm = k * (cost.dispatch + cost.combine)  # the all-to-alls, partly hidden behind it
        marks = [op for op in ops if op.mode in ("mark", "wait")]
        out.append((label, marks + [
            Op("lancet_compute", "compute", lambda p, t=busy: t / p),
            Op("lancet_all_to_all", "sync", lambda p, t=np.maximum(span - busy, 0.0): t / p, duration=comm),
        ] + [_bytes_only(op) for _, sub, _ in sublayers[seg.start:seg.end] for op in sub if op.traffic]))
        start = seg.end
    out += [(label, ops) for label, ops, _ in sublayers[start:]]
    return out


def _bytes_only(op: Op) -> Op:
    """`op`'s bytes without its time (it runs inside a Lancet pipeline op)."""
    return Op(op.name, "compute", lambda k, n=len(op.traffic): np.zeros(1), traffic=op.traffic)


