"""QK-norm (`model.qk_norm`): RMSNorm of queries and keys before rotary positions and the dot product.

* `head` (Qwen3; Megatron `qk_layernorm`): one RMSNorm over head_dim, its weight `[d]` shared by
  every head (q and k have separate weights), replicated across TP. A TP rank sees only its heads,
  so the weight enters through `copy_to_tp_region` (identity forward, all-reduce backward): every
  TP rank then holds the whole gradient, as for the other TP-replicated parameters.
* `full` (OLMoE): one RMSNorm over the whole q projection `[heads * d]` and one over the whole k
  projection `[groups * d]`. TP splits those projections by heads, so the mean square is summed over
  the TP group (`all_reduce_autograd`: its backward sums the gradient too) and the weights are
  TP-sharded like the heads.

Both normalize in fp32 with `model.norm_eps` and return the input's dtype (as HF's RMSNorm);
`head` through model/norm.py's kernels (bf16: only the bf16 input and fp32 statistics kept).
"""
from __future__ import annotations

import torch

from megatron_moe.config.errors import ConfigError
from megatron_moe.config.schema import ModelConfig
from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.norm import RMSNorm, rms_norm
from megatron_moe.tensor_parallel.param_meta import ParamMeta, make_param
from megatron_moe.tensor_parallel.mappings import copy_to_tp_region

QK_NORMS = ("none", "head", "full")


class FullRMSNorm(torch.nn.Module):
    """RMSNorm over `heads * d` features of which this TP rank holds `local_heads` heads."""

    def __init__(self, heads: int, head_dim: int, state: ParallelState, *, eps: float):
        super().__init__()
        self.eps, self.group, self.features = eps, state.tp, heads * head_dim
        self.weight = make_param(ParamMeta("dense", (heads * head_dim,), [(0, "tp")], init="ones", role="norm"), state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[b, s, local_heads, d]` -> same shape."""
        x32 = x.float()
        square_sum = C.all_reduce_autograd(x32.pow(2).sum((-2, -1), keepdim=True), self.group)  # [b, s, 1, 1]
        y = x32 * torch.rsqrt(square_sum / self.features + self.eps)
        return (y * self.weight.float().view(x.shape[-2], x.shape[-1])).to(x.dtype)


class HeadRMSNorm(RMSNorm):
    """RMSNorm over the last dim `d` of `[b, s, local_heads, d]`, weight `[d]` shared by all heads."""

    def __init__(self, head_dim: int, state: ParallelState, *, eps: float):
        super().__init__(head_dim, state, eps=eps)
        self.group = state.tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, copy_to_tp_region(self.weight, self.group), self.eps)


def build_qk_norms(cfg: ModelConfig, state: ParallelState, heads: int, groups: int, head_dim: int):
    """(q norm, k norm) modules for `model.qk_norm`, or (None, None)."""
    if cfg.qk_norm == "head":
        return HeadRMSNorm(head_dim, state, eps=cfg.norm_eps), HeadRMSNorm(head_dim, state, eps=cfg.norm_eps)
    if cfg.qk_norm == "full":
        return (FullRMSNorm(heads, head_dim, state, eps=cfg.norm_eps),
                FullRMSNorm(groups, head_dim, state, eps=cfg.norm_eps))
    return None, None


def check_qk_norm(cfg: ModelConfig) -> None:
    if cfg.qk_norm not in QK_NORMS:
        raise ConfigError(f"model.qk_norm={cfg.qk_norm!r} must be one of {', '.join(QK_NORMS)}")

