"""Learning-rate schedules (registry keyed by `optimizer.lr_schedule`): linear warmup, then decay
until `training.lr_decay_iters` (Megatron-LM's `--lr-decay-iters`; null = `training.train_iters`),
`min_lr` after it."""
from __future__ import annotations

import math
from typing import Callable, Optional

from megatron_moe.config.errors import ConfigError
from megatron_moe.config.schema import Config, OptimizerConfig
from megatron_moe.config.validate import section_check
from megatron_moe.config.registry import Registry

LR_SCHEDULES = Registry("optimizer.lr_schedule")
SCHEDULE_KEYS = ("lr_schedule", "lr", "min_lr", "warmup_iters")  # optimizer.* keys that shape the schedule


@section_check("optimizer.lr_schedule")
def _check_lr_schedule(cfg, world_size: int) -> None:
    LR_SCHEDULES.get(cfg.optimizer.lr_schedule)
    if cfg.training.lr_decay_iters is not None and cfg.training.lr_decay_iters < 1:
        raise ConfigError(f"training.lr_decay_iters={cfg.training.lr_decay_iters} must be >= 1 "
                          "(or null: decay until training.train_iters)")
    if cfg.training.lr_decay_iters is not None and cfg.training.lr_decay_iters <= cfg.optimizer.warmup_iters:
        raise ConfigError(f"training.lr_decay_iters={cfg.training.lr_decay_iters} must be > optimizer.warmup_iters="
                          f"{cfg.optimizer.warmup_iters}: the decay starts after warmup (Megatron-LM's rule)")


def decay_iters(cfg: Config) -> int:
    """The iteration at which the decay reaches `min_lr`."""
    tr = cfg.training
    return tr.lr_decay_iters if tr.lr_decay_iters is not None else tr.train_iters


def lr_schedule(cfg: Config) -> Callable[[int], float]:
    """`cfg`'s schedule, looked up once (the trainer's, at start-up): iteration (from 1) -> LR."""
    schedule, opt, total = LR_SCHEDULES.get(cfg.optimizer.lr_schedule), cfg.optimizer, decay_iters(cfg)
    return lambda iteration: schedule(opt, iteration, total)


def learning_rate(cfg: Config, iteration: int) -> float:
    """The LR of `iteration` (counted from 1) under `cfg`'s schedule."""
    return lr_schedule(cfg)(iteration)


@LR_SCHEDULES.register("cosine")
def cosine(opt: OptimizerConfig, iteration: int, total_iters: int) -> float:
    """Linear warmup over `warmup_iters`, then cosine decay from `lr` to `min_lr` at `total_iters`
    (the decay iterations). `iteration` counts from 1 (the first update)."""
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


def schedule_change(saved: Config, cfg: Config, iteration: int) -> Optional[str]:
    """One line saying how the LR moves when a run resumed after `iteration` from a checkpoint
    trained under `saved` continues under `cfg`'s schedule; None if the schedule is the same."""
    changes = [f"optimizer.{key} {getattr(saved.optimizer, key)} -> {getattr(cfg.optimizer, key)}"
               for key in SCHEDULE_KEYS if getattr(saved.optimizer, key) != getattr(cfg.optimizer, key)]
    old_end, end = decay_iters(saved), decay_iters(cfg)
    hint = ""
    if old_end != end:
        why = "" if cfg.training.lr_decay_iters is not None else \
            ", as training.lr_decay_iters=null follows training.train_iters"
        changes.append(f"the decay ends at iteration {end}, not {old_end}{why}")
        if cfg.training.lr_decay_iters is None:
            hint = f"; training.lr_decay_iters={old_end} keeps the checkpoint's schedule"
    if not changes:
        return None
    try:
        before = learning_rate(saved, iteration) if iteration > 0 else None
        old_next = learning_rate(saved, iteration + 1)
    except ConfigError:  # a schedule no longer registered
        before = old_next = None
    new_next = learning_rate(cfg, iteration + 1)
    moves = f"lr {before:.3e} at iteration {iteration} -> " if before is not None else ""
    moves += f"{new_next:.3e} at iteration {iteration + 1}"
    if old_next is not None:
        moves += f" ({old_next:.3e} under the checkpoint's schedule)"
    last = max(end, iteration + 1)
    return (f"lr schedule changed on resume ({'; '.join(changes)}): {moves}, "
            f"{learning_rate(cfg, last):.3e} at iteration {last}{hint}")
