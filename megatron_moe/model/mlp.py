"""Dense feed-forward block split across TP (Megatron-LM §3, Fig. 3a): column-parallel fc1 ->
activation -> row-parallel fc2, one all-reduce in forward.

Activations (`model.activation`, shared with the MoE experts through `ffn_activation`):
* gelu   (GPT-2; exact erf form): fc1's units `(f,)`, output `[..., f]`.
* swiglu (Shazeer 2020, Eq. 5; Mixtral): fc1's units `(2, f)` = (gate, up): the weight's global
  shape carries a separate (gate, up) dimension and is sharded on f, so a shard of f/tp units is
  `[gate units | up units]`, each half contiguous; the output `[..., 2 f/tp]` splits into its two
  halves and silu(gate) * up `[..., f/tp]` runs on contiguous rows (issue #16: an interleaved
  (gate, up) column order made silu and its backward run on stride-2 views).
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F

from megatron_moe.config.schema import ModelConfig
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.tensor_parallel import ColumnParallelLinear, RowParallelLinear


def ffn_units_shape(ffn_hidden_size: int, activation: str) -> Tuple[int, ...]:
    """Shape of the first FFN projection's output units: (f,) or, for SwiGLU, (2, f) = (gate, up)."""
    return (2, ffn_hidden_size) if activation == "swiglu" else (ffn_hidden_size,)


def ffn_activation(x: torch.Tensor, activation: str) -> torch.Tensor:
    """gelu: `[..., f] -> [..., f]`; swiglu: `[..., 2f]` = (gate half, up half) -> `[..., f]`."""
    if activation == "swiglu":
        gate, up = x.chunk(2, dim=-1)
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
