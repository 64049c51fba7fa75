"""AdamW (Loshchilov & Hutter) over this rank's parameter shards.

AdamW is element-wise, so sharding a parameter does not change its update: the same global
gradients give the same global weights on any layout. Weight decay goes by what a parameter is
(`ParamMeta.role`), not by its rank: matrices ("weight": linear weights, the router weight, the
experts' w1/w2 stacks) and embedding tables ("embedding": word, position, token-type; as in
Megatron-LM, which exempts only biases and norm parameters) decay; biases ("bias", the experts'
2-D b1/b2 stacks included) and norm scales/shifts ("norm") do not. torch's fused kernel (CPU and
CUDA; ~8x faster than the per-tensor loop torch picks by default on CPU) is used when every
parameter is a float tensor on one of those; otherwise torch's default implementation.
`optimizer.distributed` shards the state over the replicas (training/distributed_optimizer.py).
bf16 parameters (`training.precision: bf16`) get AdamW over fp32 master copies
(training/mixed_precision.py).
"""
from __future__ import annotations

from typing import List, Optional

import torch

from megatron_moe.config.schema import OptimizerConfig
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.training.distributed_optimizer import DECAYED_ROLES, DistributedOptimizer, fused_ok


def param_groups(model: torch.nn.Module, weight_decay: float) -> List[dict]:
    """[decayed group, not-decayed group] of the trainable parameters, by `param.meta.role`."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.meta.role in DECAYED_ROLES else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, cfg: OptimizerConfig, state: Optional[ParallelState] = None,
                    compiled: bool = False, overlap_experts: bool = True):
    """AdamW over the model's parameters, or with `optimizer.distributed` over this rank's ZeRO-1
    shards of them (training/distributed_optimizer.py; needs `state`). `compiled`
    (`training.compile`): bf16 parameters' AdamW and master copy as one compiled pass
    (training/mixed_precision.py). `overlap_experts`: DistributedOptimizer's."""
    if cfg.distributed:
        return DistributedOptimizer(model, cfg, state or ParallelState.single_process(), overlap_experts)
    params = [p for p in model.parameters() if p.requires_grad]
    if any(p.dtype != torch.float32 for p in params):  # bf16 parameters: fp32 masters (training/mixed_precision.py)
        from megatron_moe.training.mixed_precision import MixedPrecisionAdamW

        return MixedPrecisionAdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr,
                                   betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, fused=fused_ok(params),
                                   compiled=compiled)
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr,
                             betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                             fused=True if fused_ok(params) else None)
