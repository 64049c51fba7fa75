"""Learning-rate schedules (registry keyed by `optimizer.lr_schedule`): linear warmup, then decay."""
from __future__ import annotations

import math

from megatron_moe.config.schema import OptimizerConfig
from megatron_moe.config.validate import section_check
from megatron_moe.config.registry import Registry

LR_SCHEDULES = Registry("optimizer.lr_schedule")


@section_check("optimizer.lr_schedule")
def _check_lr_schedule(cfg, world_size: int) -> None:
    LR_SCHEDULES.get(cfg.optimizer.lr_schedule)


@LR_SCHEDULES.register("cosine")
def cosine(opt: OptimizerConfig, iteration: int, total_iters: int) -> float:
    """Linear warmup over `warmup_iters`, then cosine decay from `lr` to `min_lr` at `total_iters`.
    `iteration` counts from 1 (the first update)."""
    if opt.warmup_iters > 0 and iteration <= opt.warmup_iters:
        return opt.lr * iteration / opt.warmup_iters
    span = max(1, total_iters - opt.warmup_iters)
    progress = min(1.0, (iteration - opt.warmup_iters) / span)
    return opt.min_lr + 0.5 * (opt.lr - opt.min_lr) * (1.0 + math.cos(math.pi * progress))


@LR_SCHEDULES.register("constant")
def constant(opt: OptimizerConfig, iteration: int, total_iters: int) -> float:
    """Linear warmup, then constant `lr`."""
    if opt.warmup_iters > 0 and iteration <= opt.warmup_iters:
        return opt.lr * iteration / opt.warmup_iters
    return opt.lr
