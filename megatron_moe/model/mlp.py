"""Dense feed-forward block split across TP (Megatron-LM §3, Fig. 3a): column-parallel fc1 ->
activation -> row-parallel fc2, one all-reduce in forward.

Activations (`model.activation`, shared with the MoE experts through `ffn_activation`):
* gelu   (GPT-2; exact erf form): fc1 output `[..., f]`.
* swiglu (Shazeer 2020, Eq. 5; Mixtral): fc1 output `[..., 2f]` holds (gate, up) *interleaved per
  unit*, i.e. fc1's weight rows are ordered [unit, (gate|up)], so any contiguous shard of the FFN
  dimension holds matching gate and up columns; result silu(gate) * up `[..., f]`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_moe.config.schema import ModelConfig
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.tensor_parallel import ColumnParallelLinear, RowParallelLinear


def ffn_input_width(ffn_hidden_size: int, activation: str) -> int:
    """Width of the first FFN projection's output for `ffn_hidden_size` units."""
    return 2 * ffn_hidden_size if activation == "swiglu" else ffn_hidden_size


def ffn_activation(x: torch.Tensor, activation: str) -> torch.Tensor:
    """gelu: `[..., f] -> [..., f]`; swiglu: `[..., 2f]` interleaved (gate, up) pairs -> `[..., f]`."""
    if activation == "swiglu":
        gate, up = x.unflatten(-1, (-1, 2)).unbind(-1)  # each [..., f]
        return F.silu(gate) * up
    return F.gelu(x)


class MLP(torch.nn.Module):
    """x `[b, s, h]` replicated -> `[b, s, h]` replicated; each TP rank holds ffn_hidden_size/tp units."""

    def __init__(self, cfg: ModelConfig, state: ParallelState, *, output_std: float):
        super().__init__()
        self.activation = cfg.activation
        width = ffn_input_width(cfg.ffn_hidden_size, cfg.activation)
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, width, state, bias=cfg.bias, std=cfg.init_std)
        self.fc2 = RowParallelLinear(cfg.ffn_hidden_size, cfg.hidden_size, state, bias=cfg.bias, std=output_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(ffn_activation(self.fc1(x), self.activation))  # fc1: [b, s, width/tp]
