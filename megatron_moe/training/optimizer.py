"""AdamW (Loshchilov & Hutter) over this rank's parameter shards.

AdamW is element-wise, so sharding a parameter does not change its update: the same global
gradients give the same global weights on any layout. Weight decay applies to matrices (and
expert weight stacks, ndim >= 2), not to norm scales and biases. The fused CUDA kernel is used
when every parameter lives on a GPU; otherwise torch's foreach implementation.
"""
from __future__ import annotations

from typing import List

import torch

from megatron_moe.config.schema import OptimizerConfig


def param_groups(model: torch.nn.Module, weight_decay: float) -> List[dict]:
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, cfg: OptimizerConfig) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    fused = bool(params) and all(p.is_cuda for p in params)
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr,
                             betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                             fused=fused or None)
