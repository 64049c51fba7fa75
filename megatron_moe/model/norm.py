"""LayerNorm (Ba et al. 2016) and RMSNorm (Zhang & Sennrich 2019), parameters replicated across TP.

Both compute their statistics in fp32 and return the input's dtype. Input and output
`[..., hidden]`. bf16 parameters and input (`training.precision=bf16`, docs/precision.md):
`_Bf16Norm` normalizes in fp32 and keeps for backward only the bf16 input and the fp32 statistics
(mean, 1/std per row), as Megatron's fused norms do; torch's own kernels on bf16 would keep fp32
copies of the input (rms_norm's composite) or bf16 statistics (layer_norm). Otherwise (fp32, or
under a user's autocast) torch's kernels on fp32 copies of input and weights. Kernels: PyTorch's fused `layer_norm` / `rms_norm`; on CUDA, NVIDIA apex's fused
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
from megatron_moe.tensor_parallel.param_meta import ParamMeta, make_param


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


def _bf16(x: torch.Tensor, weight: torch.Tensor, apex) -> bool:
    """bf16 input and weight, no apex: `_Bf16Norm` (module docstring)."""
    return apex is None and x.dtype == weight.dtype == torch.bfloat16


class _Bf16Norm(torch.autograd.Function):
    """LayerNorm (`rms=False`) or RMSNorm of bf16 x [..., h] in fp32; saves x (bf16) and the fp32
    statistics [..., 1]; returns bf16. Backward: the textbook gradients, in fp32. Each direction
    works in place on its one fp32 copy of its input (x, dy): the same operations in the same
    order as the out-of-place formulas, so the same bits, with fewer fresh `[..., h]` buffers."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, rms: bool):
        x32 = x.float()  # [..., h], this function's own
        mean = None if rms else x32.mean(-1, keepdim=True)
        centred = x32 if rms else x32.sub_(mean)
        rstd = torch.rsqrt(centred.pow(2).mean(-1, keepdim=True).add_(eps))  # [..., 1]
        y = centred.mul_(rstd).mul_(weight.float())
        if bias is not None:
            y = y.add_(bias.float())
        ctx.save_for_backward(x, weight, rstd, *(() if rms else (mean,)))
        ctx.has_bias, ctx.rms = bias is not None, rms
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd, *mean = ctx.saved_tensors
        x32 = x.float()
        xhat = (x32 if ctx.rms else x32.sub_(mean[0])).mul_(rstd)  # [..., h]
        g = dy.to(torch.float32, copy=True)  # this function's own: worked on in place
        rows = g.reshape(-1, g.shape[-1])
        product = rows * xhat.reshape(rows.shape)  # [n, h], reused below
        dweight = product.sum(0).to(weight.dtype)
        dbias = rows.sum(0).to(weight.dtype) if ctx.has_bias else None
        g = g.mul_(weight.float())  # dy * weight
        c = torch.mul(g, xhat, out=product.view(g.shape)).mean(-1, keepdim=True)
        dx = xhat.mul_(c.neg_()).add_(g)  # g - xhat * mean(g * xhat)
        if not ctx.rms:
            dx = dx.sub_(g.mean(-1, keepdim=True))
        return dx.mul_(rstd).to(x.dtype), dweight, dbias, None, None


class LayerNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, state: ParallelState, *, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = make_param(ParamMeta("dense", (hidden_size,), init="ones", role="norm"), state)
        self.bias = make_param(ParamMeta("dense", (hidden_size,), init="zeros", role="norm"), state) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        apex = _apex(x)
        if _bf16(x, self.weight, apex):
            return _Bf16Norm.apply(x, self.weight, self.bias, self.eps, False)
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
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., d] with weight [d] by the module docstring's kernels (also QK-norm's, model/qk_norm.py)."""
    apex = _apex(x)
    if _bf16(x, weight, apex):
        return _Bf16Norm.apply(x, weight, None, eps, True)
    if apex is not None:
        y = apex[1](x.float(), weight.float(), x.shape[-1:], eps)
    else:
        y = F.rms_norm(x.float(), x.shape[-1:], weight.float(), eps)
    return y.to(x.dtype)


def build_norm(cfg: ModelConfig, state: ParallelState) -> torch.nn.Module:
    """The norm selected by `model.normalization` (LayerNorm has a bias iff `model.bias`)."""
    if cfg.normalization == "rmsnorm":
        return RMSNorm(cfg.hidden_size, state, eps=cfg.norm_eps)
    return LayerNorm(cfg.hidden_size, state, eps=cfg.norm_eps, bias=cfg.bias)
