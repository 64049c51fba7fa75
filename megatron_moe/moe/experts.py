"""Expert weights, sharded over EP (whole experts) and ESP (FFN dimension), and their compute.

Global parameters (all `kind="expert"`, initialized from the seed independently of the layout):

    w1 [E, h, W]  shards [(0, "ep"), (2, "esp")]   W = f (gelu) or 2f (swiglu)
    w2 [E, f, h]  shards [(0, "ep"), (1, "esp")]
    b1 [E, W]     shards [(0, "ep"), (1, "esp")]   (model.bias)
    b2 [E, h]     shards [(0, "ep"), (1, "esp")]   (model.bias; sharded on h, see below)

Expert e computes act(x w1[e] + b1[e]) w2[e] + b2[e]. ESP rank j holds FFN units
[j f/esp, (j+1) f/esp) and produces a partial sum over those units (Parm §II-B, like Megatron's
row-parallel layer); the schedule adds the shards' partial sums (ESP-AllReduce, or a local combine).
SwiGLU: w1's columns hold (gate, up) interleaved per unit (column 2u = gate of unit u, 2u+1 =
up), the convention of `model/mlp.py`, so any contiguous ESP shard of W holds matching gate and
up columns. b2 is sharded along h: ESP rank j adds its h-slice of b2 into columns
[j h/esp, (j+1) h/esp) of its partial output (zeros elsewhere), so the summed output contains b2
exactly once and b2's gradient needs no extra synchronization.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch
import torch.nn.functional as F

from megatron_moe.config.schema import Config
from megatron_moe.config.validate import expert_ffn_hidden_size
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.mlp import ffn_activation, ffn_input_width
from megatron_moe.model.param_meta import ParamMeta, make_param
from megatron_moe.model.transformer import residual_output_std


@dataclass
class ExpertBatch:
    """Rows to compute on this rank, grouped by expert."""

    tokens: torch.Tensor  # [m, h], expert_ids[0]'s rows first
    expert_ids: List[int]  # global expert ids, ascending
    counts: List[int]  # rows per expert (sums to m)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Identity forward; multiplies the gradient by `scale` in backward."""
    return x if scale == 1.0 else _ScaleGrad.apply(x, scale)


class Experts(torch.nn.Module):
    """This rank's E/ep experts, ESP shard `state.esp.rank` of each."""

    def __init__(self, cfg: Config, state: ParallelState):
        super().__init__()
        m, num_experts = cfg.model, cfg.moe.num_experts
        ffn = expert_ffn_hidden_size(cfg)
        width = ffn_input_width(ffn, m.activation)
        self.activation = m.activation
        self.num_local = num_experts // state.ep_size
        self.first_expert = state.ep.rank * self.num_local
        self.hidden_size, self.esp_rank = m.hidden_size, state.esp.rank

        def param(shape, dim, init="normal", std=0.0, role="weight"):
            return make_param(ParamMeta("expert", (num_experts,) + shape, [(0, "ep"), (dim, "esp")],
                                        init=init, std=std, role=role), state)

        self.w1 = param((m.hidden_size, width), 2, std=m.init_std)
        self.w2 = param((ffn, m.hidden_size), 1, std=residual_output_std(m))
        self.b1 = param((width,), 1, init="zeros", role="bias") if m.bias else None
        self.b2 = param((m.hidden_size,), 1, init="zeros", role="bias") if m.bias else None

    def forward(self, batch: ExpertBatch, grad_scale: float = 1.0) -> torch.Tensor:
        """[m, h] rows -> [m, h] partial sums of this ESP shard (b2 slice included).
        `grad_scale` multiplies the weights' gradients (the schedule's redundancy correction)."""
        w1, w2 = scale_grad(self.w1, grad_scale), scale_grad(self.w2, grad_scale)
        b1 = scale_grad(self.b1, grad_scale) if self.b1 is not None else None
        b2 = scale_grad(self.b2, grad_scale) if self.b2 is not None else None
        outputs = []
        for expert, rows in zip(batch.expert_ids, batch.tokens.split(batch.counts)):
            i = expert - self.first_expert
            assert 0 <= i < self.num_local, f"expert {expert} is not held by this rank"
            hidden = rows @ w1[i]  # [m_e, W/esp]
            if b1 is not None:
                hidden = hidden + b1[i]
            out = ffn_activation(hidden, self.activation) @ w2[i]  # [m_e, h] partial over FFN units
            if b2 is not None:
                out = out + self._own_columns(b2[i])
            outputs.append(out)
        return torch.cat(outputs)  # every rank computes at least the experts it owns

    def _own_columns(self, b2_slice: torch.Tensor) -> torch.Tensor:
        """[h/esp] -> [h]: this shard's slice of b2 at its columns, zeros elsewhere."""
        width = b2_slice.shape[0]
        before = self.esp_rank * width
        return F.pad(b2_slice, (before, self.hidden_size - before - width))
