"""Combination checks that run before any process group exists (DESIGN.md §2).

Each failure is a `ConfigError` whose one-line message names the key(s) and the rule, e.g.
`parallel.expert=3 does not divide moe.num_experts=8`.

This module holds the rules about the config tree itself (choices, positive sizes, how the
parallel degrees divide the model and the world). Every other section is checked by the code that
knows its rule, registered into `SECTION_CHECKS` next to that code (a registry's names, a
technique's options, attention heads and query groups, the router's and shared experts' keys, the
pipeline, the checkpoint, the hardware profile). `validate_config` runs
them at fixed points of `SECTION_CHECKS.order`, so the first broken rule is reported in the same
order as always; loading the plugins (megatron_moe/config/registry.py) makes sure every one is registered.
"""
from __future__ import annotations

from typing import Optional

from megatron_moe.config.errors import ConfigError
from megatron_moe.config.load import resolve_defaults
from megatron_moe.config.schema import Config
from megatron_moe.config.registry import Hooks

# (cfg, world_size) -> None, raising ConfigError; run in this order (names: the section they check)
SECTION_CHECKS: Hooks = Hooks("config section check", (
    # selected entries of the registries
    "moe.schedule", "moe.balancer", "moe.gate", "moe.token_dispatch", "optimizer.lr_schedule", "data.tokenizer.type",
    # the techniques' options and the hardware profile their cost models need
    "parm", "moe.lancet.partitions", "moe.smart_schedule", "moe.node_dedup", "moe.fastermoe",
    "moe.proprophet", "moe.flexmoe", "moe.eplb", "perf.hardware_profile",
    "moe.topology_gate",  # after parallel.ranks_per_node
    "model.attention", "moe.router", "moe.shared_expert",  # the architecture, after the degrees divide the world
    "moe.layer_pattern", "model.mtp_depth",  # dense / MoE layers by position (model/transformer.py), MTP (model/mtp.py)
    "parallel.pipeline_schedule", "optimizer.distributed", "optimizer.overlap_grad_reduce",  # after the batch sizes
    "evaluation",  # lm-eval tasks during training (evaluation/during_training.py)
    "checkpoint",  # last
))
_SELECTION_AND_TECHNIQUES = SECTION_CHECKS.order[:SECTION_CHECKS.order.index("moe.topology_gate")]


def section_check(name: str):
    """Decorator: register `fn(cfg, world_size)` as the check of section `name` (one of
    `SECTION_CHECKS.order`)."""
    return SECTION_CHECKS.register(name)


def _run_checks(cfg: Config, world_size: int, names) -> None:
    for _, check in SECTION_CHECKS.items(names):
        check(cfg, world_size)

CHOICES = {
    "model.normalization": ("layernorm", "rmsnorm"),
    "model.activation": ("gelu", "swiglu"),
    "model.position_embedding": ("learned", "rope"),
    "training.precision": ("fp32", "bf16"),
    "parallel.backend": ("auto", "gloo", "nccl"),
    "model.binary_head": ("sop", "nsp", "none"),
    "training.on_nonfinite": ("skip", "stop"),
    "training.recompute": ("none", "selective", "full"),
}

POSITIVE = (
    "model.num_layers", "model.hidden_size", "model.ffn_hidden_size", "model.num_attention_heads",
    "model.seq_length", "model.vocab_size", "moe.num_experts", "moe.top_k", "moe.layer_freq",
    "parallel.tensor", "parallel.expert", "parallel.expert_shard", "parallel.pipeline",
    "training.micro_batch_size", "training.global_batch_size", "training.log_interval",
)


def _get(cfg: Config, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def _divides(a_key: str, a: int, b_key: str, b: int) -> None:
    if b % a != 0:
        raise ConfigError(f"{a_key}={a} does not divide {b_key}={b}")


def expert_ffn_hidden_size(cfg: Config) -> int:
    return cfg.moe.expert_ffn_hidden_size or cfg.model.ffn_hidden_size


EXPERT_ACTIVATIONS = ("gelu", "swiglu", "swiglu_oss")  # moe.activation (model/mlp.py `ffn_activation`)
GATED = ("swiglu", "swiglu_oss")  # activations of (gate, up) halves: first projections [.., 2, f]


def expert_activation(cfg: Config) -> str:
    """The experts' activation: `moe.activation`, null = `model.activation`."""
    return cfg.moe.activation or cfg.model.activation


def expert_proj_bias(cfg: Config) -> bool:
    """Whether the experts' projections have biases b1 / b2: `moe.expert_proj_bias`, null = `model.bias`."""
    return cfg.model.bias if cfg.moe.expert_proj_bias is None else cfg.moe.expert_proj_bias


def validate_config(cfg: Config, world_size: int) -> None:
    """Raise ConfigError for the first rule `cfg` breaks on `world_size` processes (after filling the
    derived null keys of a config not built by `load_config`: `resolve_defaults`)."""
    resolve_defaults(cfg)
    for key, allowed in CHOICES.items():
        if _get(cfg, key) not in allowed:
            raise ConfigError(f"{key}={_get(cfg, key)!r} must be one of {', '.join(allowed)}")
    for key in POSITIVE:
        if _get(cfg, key) < 1:
            raise ConfigError(f"{key}={_get(cfg, key)} must be >= 1")
    m, moe, par, tr, opt = cfg.model, cfg.moe, cfg.parallel, cfg.training, cfg.optimizer
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout={m.dropout} must be in [0, 1)")
    if moe.top_k > moe.num_experts:
        raise ConfigError(f"moe.top_k={moe.top_k} exceeds moe.num_experts={moe.num_experts}")
    if moe.capacity_factor is not None and moe.capacity_factor <= 0:
        raise ConfigError(f"moe.capacity_factor={moe.capacity_factor} must be > 0 (or null for dropless)")
    if moe.expert_ffn_hidden_size is not None and moe.expert_ffn_hidden_size < 1:
        raise ConfigError(f"moe.expert_ffn_hidden_size={moe.expert_ffn_hidden_size} must be >= 1 or null")
    if moe.activation is not None and moe.activation not in EXPERT_ACTIVATIONS:
        raise ConfigError(f"moe.activation={moe.activation!r} must be null (model.activation) or one of "
                          f"{', '.join(EXPERT_ACTIVATIONS)}")
    if moe.swiglu_limit <= 0:
        raise ConfigError(f"moe.swiglu_limit={moe.swiglu_limit} must be > 0")
    _run_checks(cfg, world_size, _SELECTION_AND_TECHNIQUES)
    if par.ranks_per_node is not None and (par.ranks_per_node < 1 or world_size % par.ranks_per_node):
        raise ConfigError(f"parallel.ranks_per_node={par.ranks_per_node} must be >= 1 and divide the world size {world_size}")
    _run_checks(cfg, world_size, ("moe.topology_gate",))

    if world_size % (par.tensor * par.pipeline) != 0:
        raise ConfigError(
            f"world size {world_size} is not divisible by parallel.tensor*parallel.pipeline="
            f"{par.tensor}*{par.pipeline}")
    stage_size = world_size // par.pipeline
    _divides("parallel.expert", par.expert, "moe.num_experts", moe.num_experts)
    if stage_size % (par.expert * par.expert_shard) != 0:
        raise ConfigError(
            f"parallel.expert*parallel.expert_shard={par.expert}*{par.expert_shard} does not divide the "
            f"{stage_size} ranks of a pipeline stage (world size {world_size} / parallel.pipeline)")
    _run_checks(cfg, world_size, ("model.attention", "moe.router", "moe.shared_expert", "moe.layer_pattern",
                                  "model.mtp_depth"))
    _divides("parallel.tensor", par.tensor, "model.ffn_hidden_size", m.ffn_hidden_size)
    ffn_key = "moe.expert_ffn_hidden_size" if moe.expert_ffn_hidden_size else "model.ffn_hidden_size"
    _divides("parallel.expert_shard", par.expert_shard, ffn_key, expert_ffn_hidden_size(cfg))
    if expert_proj_bias(cfg):  # the experts' output bias b2 [E, h] is sharded over ESP along h (moe/experts.py)
        _divides("parallel.expert_shard", par.expert_shard, "model.hidden_size", m.hidden_size)

    dp = stage_size // par.tensor
    if tr.global_batch_size % (tr.micro_batch_size * dp) != 0:
        raise ConfigError(
            f"training.global_batch_size={tr.global_batch_size} is not divisible by "
            f"training.micro_batch_size*data_parallel={tr.micro_batch_size}*{dp}")
    _run_checks(cfg, world_size, ("parallel.pipeline_schedule", "optimizer.distributed",
                                  "optimizer.overlap_grad_reduce"))
    if tr.train_iters < 0 or tr.eval_interval < 0 or tr.eval_iters < 0:
        raise ConfigError("training.train_iters, training.eval_interval and training.eval_iters must be >= 0")
    if tr.inject_nan_at < 0 or cfg.logging.image_interval < 0:
        raise ConfigError("training.inject_nan_at and logging.image_interval must be >= 0 (0 = off)")
    if opt.lr <= 0 or opt.min_lr < 0 or opt.min_lr > opt.lr:
        raise ConfigError(f"optimizer.min_lr={opt.min_lr} and optimizer.lr={opt.lr} need 0 <= min_lr <= lr, lr > 0")
    if opt.warmup_iters < 0 or opt.clip_grad < 0 or opt.weight_decay < 0:
        raise ConfigError("optimizer.warmup_iters, optimizer.clip_grad and optimizer.weight_decay must be >= 0")
    for key in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(opt, key) < 1.0:
            raise ConfigError(f"optimizer.{key}={getattr(opt, key)} must be in [0, 1)")
    _run_checks(cfg, world_size, ("evaluation", "checkpoint"))


def validate_placement(cfg: Config, placement) -> Optional[int]:
    """The ranks per node of the run: `parallel.ranks_per_node` checked against where the ranks
    really are (`placement`, a launch.Placement; None = unknown). Ranks on one host: the config's
    value (null = one node; a value simulates nodes on one machine). On several hosts the ranks must
    fill them in equal blocks of consecutive ranks, M each (node = rank // M, as RankLayout assumes),
    and the config must say M or nothing."""
    configured = cfg.parallel.ranks_per_node
    if placement is None or len(placement.nodes()) == 1:
        return configured
    size = placement.block_size()
    if size is None:
        raise ConfigError(f"parallel.ranks_per_node: the ranks are not placed in equal blocks of consecutive ranks per "
                          f"node ({placement.describe()}); start the same number on every node in block order "
                          f"(sbatch -N NODES --ntasks-per-node=N, torchrun --nproc-per-node=N)")
    if configured is not None and configured != size:
        raise ConfigError(f"parallel.ranks_per_node={configured} contradicts where the ranks run ({placement.describe()}): "
                          f"set it to {size} or leave it null to take it from the launcher")
    return size




def micro_batches(cfg: Config, world_size: int) -> int:
    """Micro-batches per data-parallel rank and iteration (the config validated up to the batch sizes)."""
    par, tr = cfg.parallel, cfg.training
    dp = world_size // par.pipeline // par.tensor
    return tr.global_batch_size // (tr.micro_batch_size * dp)
