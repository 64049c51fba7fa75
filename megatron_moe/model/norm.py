"""LayerNorm (Ba et al. 2016) and RMSNorm (Zhang & Sennrich 2019), parameters replicated across TP.

Both compute their statistics in fp32 and return the input's dtype. Input and output
`[..., hidden]`. bf16 parameters and input (`training.precision=bf16`, docs/precision.md): torch's
fused kernels take them as they are and reduce in fp32 inside (their opmath type), so autograd
keeps the bf16 input for backward, not an fp32 copy of it (rms_norm: bitwise the fp32 computation
rounded once; layer_norm: within one bf16 ulp). Otherwise (fp32, or under a user's autocast) the
input and weights are cast to fp32 first. Kernels: PyTorch's fused `layer_norm` / `rms_norm`; on CUDA, NVIDIA apex's fused
kernels instead when the real apex is installed (`apex_fused_norms`: its compiled
`fused_layer_norm_cuda` extension must import; the unrelated PyPI package named `apex` has none
and is never used).
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron_moe.config.schema import ModelConfig
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.param_meta import ParamMeta, make_param


@functools.lru_cache(maxsize=None)
def apex_fused_norms() -> Optional[Tuple[Callable, Callable]]:
    """(fused_layer_norm_affine, fused_rms_norm_affine) of NVIDIA apex, or None when the real apex
    (with its compiled CUDA extension) is not importable."""
    try:
        import fused_layer_norm_cuda  # noqa: F401  the real apex's compiled kernels
        from apex.normalization.fused_layer_norm import fused_layer_norm_affine, fused_rms_norm_affine
    except ImportError:
        return None
    return fused_layer_norm_affine, fused_rms_norm_affine


def _apex(x: torch.Tensor) -> Optional[Tuple[Callable, Callable]]:
    return apex_fused_norms() if x.is_cuda else None


def _native_low_precision(x: torch.Tensor, weight: torch.Tensor, apex) -> bool:
    """bf16 input and weight, torch's kernels: they normalize in fp32 inside (module docstring)."""
    return apex is None and x.dtype == weight.dtype == torch.bfloat16


class LayerNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, state: ParallelState, *, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = make_param(ParamMeta("dense", (hidden_size,), init="ones", role="norm"), state)
        self.bias = make_param(ParamMeta("dense", (hidden_size,), init="zeros", role="norm"), state) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        apex = _apex(x)
        if _native_low_precision(x, self.weight, apex):
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        bias = None if self.bias is None else self.bias.float()
        if apex is not None and bias is not None:
            y = apex[0](x.float(), self.weight.float(), bias, x.shape[-1:], self.eps)
        else:
            y = F.layer_norm(x.float(), x.shape[-1:], self.weight.float(), bias, self.eps)
        return y.to(x.dtype)


class RMSNorm(torch.nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight."""

    def __init__(self, hidden_size: int, state: ParallelState, *, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = make_param(ParamMeta("dense", (hidden_size,), init="ones", role="norm"), state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        apex = _apex(x)
        if _native_low_precision(x, self.weight, apex):
            return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)
        if apex is not None:
            y = apex[1](x.float(), self.weight.float(), x.shape[-1:], self.eps)
        else:
            y = F.rms_norm(x.float(), x.shape[-1:], self.weight.float(), self.eps)
        return y.to(x.dtype)


def build_norm(cfg: ModelConfig, state: ParallelState) -> torch.nn.Module:
    """The norm selected by `model.normalization` (LayerNorm has a bias iff `model.bias`)."""
    if cfg.normalization == "rmsnorm":
        return RMSNorm(cfg.hidden_size, state, eps=cfg.norm_eps)
    return LayerNorm(cfg.hidden_size, state, eps=cfg.norm_eps, bias=cfg.bias)
