"""Dense feed-forward block split across TP (Megatron-LM §3, Fig. 3a): column-parallel fc1 ->
activation -> row-parallel fc2, one all-reduce in forward.

Activations (`model.activation`, shared with the MoE experts through `ffn_activation`):
* gelu   (GPT-2; exact erf form): fc1's units `(f,)`, output `[..., f]`.
* swiglu (Shazeer 2020, Eq. 5; Mixtral): fc1's units `(2, f)` = (gate, up): the weight's global
  shape carries a separate (gate, up) dimension and is sharded on f, so a shard of f/tp units is
  `[gate units | up units]`, each half contiguous; the output `[..., 2 f/tp]` splits into its two
  halves and silu(gate) * up `[..., f/tp]` runs on contiguous rows (issue #16: an interleaved
  (gate, up) column order made silu and its backward run on stride-2 views).
* swiglu_oss (gpt-oss; experts only, `moe.activation`): the same (gate, up) halves, clamped to
  `moe.swiglu_limit` L: gate = min(gate, L), up = clamp(up, -L, L), out = (up + 1) * gate *
  sigmoid(1.702 gate) (transformers' `GptOssExperts._apply_gate`, whose checkpoint interleaves
  gate / up columns: the HF converters reorder them into the halves).
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F

from megatron_moe.config.schema import ModelConfig
from megatron_moe.config.validate import GATED
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.tensor_parallel import ColumnParallelLinear, RowParallelLinear


OSS_ALPHA = 1.702  # gpt-oss's sigmoid slope (transformers' `swiglu_alpha`)


def ffn_units_shape(ffn_hidden_size: int, activation: str) -> Tuple[int, ...]:
    """Shape of the first FFN projection's output units: (f,) or, gated, (2, f) = (gate, up)."""
    return (2, ffn_hidden_size) if activation in GATED else (ffn_hidden_size,)


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up of x `[..., 2f]` = (gate half, up half) -> `[..., f]`, saving what autograd
    would (gate, up, silu(gate)). Backward writes d gate and d up into the two halves of one
    `[..., 2f]` gradient, where autograd through `chunk` computes each apart and then concatenates
    them (a copy of the whole `[m, 2f]` gradient per layer: docs/performance.md, "bf16"); the
    values are autograd's, bit for bit (the same kernels: `silu_backward` of grad * up, grad * silu)."""

    @staticmethod
    def forward(ctx, x):
        gate, up = x.chunk(2, dim=-1)
        activated = F.silu(gate)
        ctx.save_for_backward(gate, up, activated)
        return activated * up

    @staticmethod
    def backward(ctx, grad):
        gate, up, activated = ctx.saved_tensors
        dx = grad.new_empty(grad.shape[:-1] + (2 * grad.shape[-1],))  # [..., 2f]
        d_gate, d_up = dx.chunk(2, dim=-1)
        torch.mul(grad, activated, out=d_up)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=d_gate)
        return dx


def ffn_activation(x: torch.Tensor, activation: str, limit: float = 7.0) -> torch.Tensor:
    """gelu: `[..., f] -> [..., f]`; swiglu, swiglu_oss (clamped at `limit`): `[..., 2f]` = (gate
    half, up half) -> `[..., f]`."""
    if activation == "swiglu_oss":
        gate, up = x.chunk(2, dim=-1)
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(OSS_ALPHA * gate))
    if activation == "swiglu":
        if torch.is_grad_enabled() and x.requires_grad and not torch.compiler.is_compiling():
            return _SwiGLU.apply(x)
        gate, up = x.chunk(2, dim=-1)  # no gradient, or traced: Inductor fuses the plain formula
        return F.silu(gate) * up
    return F.gelu(x)


class MLP(torch.nn.Module):
    """x `[b, s, h]` replicated -> `[b, s, h]` replicated; each TP rank holds ffn_hidden_size/tp units."""

    def __init__(self, cfg: ModelConfig, state: ParallelState, *, output_std: float):
        super().__init__()
        self.activation = cfg.activation
        units = ffn_units_shape(cfg.ffn_hidden_size, cfg.activation)
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, units[-1], state, bias=cfg.bias, std=cfg.init_std,
                                        halves=len(units) == 2)
        self.fc2 = RowParallelLinear(cfg.ffn_hidden_size, cfg.hidden_size, state, bias=cfg.bias, std=output_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(ffn_activation(self.fc1(x), self.activation))  # fc1: [b, s, width/tp]
