"""Expert weights, sharded over EP (whole experts) and ESP (FFN dimension), and their compute.

Global parameters (all `kind="expert"`, initialized from the seed independently of the layout):

    w1 [E, h, f]     gelu     shards [(0, "ep"), (2, "esp")]
    w1 [E, h, 2, f]  swiglu, swiglu_oss   shards [(0, "ep"), (3, "esp")]   (gate, up) halves, `model/mlp.py`
    w2 [E, f, h]              shards [(0, "ep"), (1, "esp")]
    b1 [E, f] | [E, 2, f]     shards [(0, "ep"), (last, "esp")]   (moe.expert_proj_bias, null = model.bias)
    b2 [E, h]                 shards [(0, "ep"), (1, "esp")]      (the same key; sharded on h, see below)

The activation is `moe.activation` (null = model.activation; swiglu_oss = gpt-oss's clamped
SwiGLU at `moe.swiglu_limit`).

Expert e computes act(x w1[e] + b1[e]) w2[e] + b2[e]. ESP rank j holds FFN units
[j f/esp, (j+1) f/esp) (for SwiGLU the gate and the up units of that range, contiguous: its local
w1 [E_l, h, 2, f/esp] is one [h, 2 f/esp] matrix per expert) and produces a partial sum over those
units (Parm §II-B, like Megatron's row-parallel layer); the schedule adds the shards' partial sums
(ESP-AllReduce, or a local combine). b2 is sharded along h: ESP rank j adds its h-slice of b2 into
columns [j h/esp, (j+1) h/esp) of its partial output (zeros elsewhere), so the summed output
contains b2 exactly once and b2's gradient needs no extra synchronization.

Compute: the batch holds every owned expert's rows (ascending), then the rows of the replicas the
placement gave this rank (`Placement.experts_on`). Owned experts run through the parameter
stacks themselves, replicas through the weights *Trans* moved in (`moe/replicas.py`), each as one
grouped GEMM per projection (`moe/grouped_gemm.py`): no per-expert indexing of the stacks. The
owned w1 / w2 go through `grouped_mm_into_grad`, which adds their weight gradient (times
`grad_scale`, the schedule's redundancy correction) straight into the held rows of `.grad`
instead of through autograd: no `[E, ...]` gradient is allocated and added per micro-batch.

vExpert slots (`slots_per_rank`, FlexMoE / EPLB, `moe/vexperts.py`): `slot_table` says which
expert each of the rank's V slots holds; the local stacks hold one row per expert the rank holds
(`SlotTable.resident`, ascending), not one per slot: vExperts of one expert on a rank share a row
(FlexMoE §3.1) and a free slot holds nothing. The row count changes when moves change the rank's
experts (`moe/vexpert_moves.py`; the parameters are `varying_rows`), and the parameters carry
`expert_rows` for checkpoints and initialization and `vexpert_slots` for the gradient norm.

Lancet (`moe.lancet.defer_wgrad`, `techniques/lancet/lancet.py`): with `wgrad` set, those weight-gradient
additions are queued for the model's `WGradScheduler` instead of run in backward.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

from megatron_moe.config.schema import Config
from megatron_moe.config.validate import expert_activation, expert_ffn_hidden_size, expert_proj_bias
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.mlp import ffn_activation, ffn_units_shape
from megatron_moe.perf import host_sync
from megatron_moe.tensor_parallel.param_meta import ParamMeta, make_param, residual_output_std
from megatron_moe.moe.grouped_gemm import grouped_mm, grouped_mm_into_grad, scale_grad, to_row_buckets
from megatron_moe.moe.vexperts import SlotTable, expert_rows


@dataclass
class ExpertBatch:
    """Rows to compute on this rank, grouped by expert (`Placement.experts_on` order)."""

    tokens: torch.Tensor  # [m, h], expert_ids[0]'s rows first
    expert_ids: List[int]  # global expert ids: every owned expert (ascending), then replicas (ascending)
    counts: List[int]  # rows per expert (sums to m)
    # Long[G] `counts` on the tokens' device, where the schedule sent them down with its orders
    # (one buffer, `schedules/base.py` `upload`); None: sent here
    device_counts: Optional[torch.Tensor] = None


class Experts(torch.nn.Module):
    """This rank's E/ep experts (or `slots_per_rank` vExpert slots), ESP shard `state.esp.rank` of each."""

    def __init__(self, cfg: Config, state: ParallelState, slots_per_rank: Optional[int] = None):
        super().__init__()
        m, num_experts = cfg.model, cfg.moe.num_experts
        self.activation, self.swiglu_limit = expert_activation(cfg), cfg.moe.swiglu_limit
        units = ffn_units_shape(expert_ffn_hidden_size(cfg), self.activation)  # (f,) or (2, f)
        self.activation_fn = ffn_activation  # training.compile: a compiled one (model/compile.py)
        self.num_experts, self.num_local = num_experts, num_experts // state.ep_size
        self.ep_rank, self.first_expert = state.ep.rank, state.ep.rank * self.num_local
        self.hidden_size, self.esp_rank = m.hidden_size, state.esp.rank
        self.slot_table = (SlotTable.initial(num_experts, state.ep_size, slots_per_rank, state.ep.rank)
                           if slots_per_rank is not None else None)
        self.wgrad = None  # Lancet's WGradScheduler (techniques/lancet/lancet.py): w1 / w2 gradients deferred in backward

        def param(shape, dim, init="normal", std=0.0, role="weight"):
            meta = ParamMeta("expert", (num_experts,) + shape, [(0, "ep"), (dim, "esp")], init=init, std=std, role=role)
            if self.slot_table is None:
                return make_param(meta, state)
            rows = len(self.slot_table.resident(state.ep.rank))  # one per expert held, not per slot
            p = torch.nn.Parameter(torch.zeros((rows,) + meta.local_shape(state)[1:]))
            p.meta, p.vexpert_slots, p.varying_rows = meta, self.slot_table, True
            p.expert_rows = lambda: expert_rows(self.slot_table)
            return p

        self.w1 = param((m.hidden_size,) + units, 1 + len(units), std=m.init_std)
        self.w2 = param((units[-1], m.hidden_size), 1, std=residual_output_std(m))
        bias = expert_proj_bias(cfg)
        self.b1 = param(units, len(units), init="zeros", role="bias") if bias else None
        self.b2 = param((m.hidden_size,), 1, init="zeros", role="bias") if bias else None

    @property
    def owned_expert_ids(self) -> List[int]:
        """The experts this rank holds: its owned range, or what its vExpert slots hold (ascending)."""
        if self.slot_table is not None:
            return self.slot_table.resident(self.ep_rank)
        return list(range(self.first_expert, self.first_expert + self.num_local))

    def stacks(self) -> List[torch.Tensor]:
        """The parameters *Trans* moves for a replica, in a fixed order (moe/replicas.py)."""
        return [p for p in (self.w1, self.w2, self.b1, self.b2) if p is not None]

    def forward(self, batch: ExpertBatch, replicas=None, grad_scale: float = 1.0) -> torch.Tensor:
        """[m, h] rows -> [m, h] partial sums of this ESP shard (b2 slice included). `replicas`:
        `moe/replicas.py` `fetch_replicas`'s result for the placement the batch came from. `grad_scale` multiplies
        the weights' gradients (the schedule's redundancy correction), replicas' included."""
        owned = self.owned_expert_ids
        if batch.expert_ids[: len(owned)] != owned:
            raise ValueError(f"EP rank {self.ep_rank}: expert batch {batch.expert_ids} must start with the "
                             f"experts it holds {owned} (Placement.experts_on)")
        extra = batch.expert_ids[len(owned):]
        held = replicas.expert_ids if replicas is not None else []
        if extra != held:
            missing = sorted(set(extra) - set(held)) or extra
            raise LookupError(f"EP rank {self.ep_rank} was asked to compute expert(s) {missing}, which it neither "
                              f"owns ({owned}) nor received as replicas ({held})")
        own_rows = sum(batch.counts[: len(owned)])
        sent = batch.device_counts
        if sent is None:  # one buffer down for both parts
            sent = host_sync.to_device([torch.tensor(batch.counts, dtype=torch.long)], batch.tokens.device, "counts")[0]
        # biases through autograd; w1 / w2: the leaves themselves (every row: one per held expert)
        held = [self.w1, self.w2] + [scale_grad(p, grad_scale) for p in (self.b1, self.b2) if p is not None]
        # a vExpert rank may hold no expert at all (its slots all free): nothing of its own to compute
        outputs = [self._ffn(batch.tokens[:own_rows], held, batch.counts[: len(owned)], grad_scale,
                             sent[: len(owned)]) if owned else batch.tokens[:0]]
        if replicas is not None:  # also with no rows here: Trans's backward (Agg) must run on every rank
            outputs.append(self._ffn(batch.tokens[own_rows:], [scale_grad(p, grad_scale) for p in replicas.stacks()],
                                     batch.counts[len(owned):], device_counts=sent[len(owned):]))
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]

    def _ffn(self, x: torch.Tensor, params: Sequence[torch.Tensor], counts: List[int],
             own_grad_scale: Optional[float] = None, device_counts: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [m, h] grouped by expert (`counts`; `device_counts` the same on x's device) through
        stacked shards (`stacks()` order) -> [m, h]. With `own_grad_scale`, w1 / w2 are this
        module's own stacks and their weight gradients, times the scale, go straight into
        `.grad`, in backward or deferred by Lancet's scheduler (`grouped_mm_into_grad`)."""
        w1, w2 = params[0], params[1]
        b1, b2 = (params[2], params[3]) if len(params) == 4 else (None, None)
        experts = len(counts)
        # CPU bf16: both projections on row buckets, padded once here (moe/grouped_gemm.py); the
        # padding rows' outputs are dropped at the end, so their gradients are zero
        x, counts, positions = to_row_buckets(x, counts)
        rows = (device_counts if positions is None and device_counts is not None  # Long[G] rows per expert
                else torch.tensor(counts, dtype=torch.long))  # (CPU row buckets: the padded counts)

        def project(inputs, weight):  # [m, k] through [G, k, n]
            if own_grad_scale is None:
                return grouped_mm(inputs, weight.reshape(experts, weight.shape[1], math.prod(weight.shape[2:])), counts,
                                  rows)
            return grouped_mm_into_grad(inputs, weight, own_grad_scale, counts, self.wgrad, rows)

        hidden = project(x, w1)  # [m, W/esp]
        if b1 is not None:
            hidden = hidden + b1.reshape(experts, math.prod(b1.shape[1:])).repeat_interleave(
                rows, dim=0, output_size=x.shape[0])
        hidden = self.activation_fn(hidden, self.activation, self.swiglu_limit)
        out = project(hidden, w2)  # [m, h] partial over FFN units
        if b2 is not None:
            bias = b2.repeat_interleave(rows, dim=0, output_size=x.shape[0])  # [m, h/esp]
            before = self.esp_rank * bias.shape[1]
            out = out + F.pad(bias, (before, self.hidden_size - before - bias.shape[1]))
        return out if positions is None else out.index_select(0, positions)

