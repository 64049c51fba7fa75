"""LayerNorm (Ba et al. 2016) and RMSNorm (Zhang & Sennrich 2019), parameters replicated across TP.

Both normalize in fp32 (also under bf16 autocast) and return the input's dtype. Input and output
`[..., hidden]`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_moe.config.schema import ModelConfig
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.param_meta import ParamMeta, make_param


class LayerNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, state: ParallelState, *, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = make_param(ParamMeta("dense", (hidden_size,), init="ones", role="norm"), state)
        self.bias = make_param(ParamMeta("dense", (hidden_size,), init="zeros", role="norm"), state) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        y = F.layer_norm(x.float(), x.shape[-1:], self.weight.float(), bias, self.eps)
        return y.to(x.dtype)


class RMSNorm(torch.nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight."""

    def __init__(self, hidden_size: int, state: ParallelState, *, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = make_param(ParamMeta("dense", (hidden_size,), init="ones", role="norm"), state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.weight.float()
        return y.to(x.dtype)


def build_norm(cfg: ModelConfig, state: ParallelState) -> torch.nn.Module:
    """The norm selected by `model.normalization` (LayerNorm has a bias iff `model.bias`)."""
    if cfg.normalization == "rmsnorm":
        return RMSNorm(cfg.hidden_size, state, eps=cfg.norm_eps)
    return LayerNorm(cfg.hidden_size, state, eps=cfg.norm_eps, bias=cfg.bias)
