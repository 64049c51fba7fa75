"""Combination checks that run before any process group exists (DESIGN.md §2).

Each failure is a `ConfigError` whose one-line message names the key(s) and the rule, e.g.
`parallel.expert=3 does not divide moe.num_experts=8`.
"""
from __future__ import annotations

from typing import Optional

from megatron_moe.config.errors import ConfigError
from megatron_moe.config.schema import Config

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


def validate_config(cfg: Config, world_size: int) -> None:
    """Raise ConfigError for the first rule `cfg` breaks on `world_size` processes."""
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
    _check_registries(cfg)
    _check_parm(cfg)
    if par.ranks_per_node is not None and (par.ranks_per_node < 1 or world_size % par.ranks_per_node):
        raise ConfigError(f"parallel.ranks_per_node={par.ranks_per_node} must be >= 1 and divide the world size {world_size}")
    if moe.gate == "topology" and moe.schedule == "s1":
        raise ConfigError("moe.gate=topology does not work with moe.schedule=s1 (S1 gates each TP rank's piece "
                          "separately; the gate's budget covers the whole micro-batch): use s2 or auto")
    if moe.topology_gate.bandwidth_ratio <= 0:
        raise ConfigError(f"moe.topology_gate.bandwidth_ratio={moe.topology_gate.bandwidth_ratio} must be > 0")

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
    _divides("parallel.tensor", par.tensor, "model.num_attention_heads", m.num_attention_heads)
    _divides("model.num_attention_heads", m.num_attention_heads, "model.hidden_size", m.hidden_size)
    if m.position_embedding == "rope" and (m.hidden_size // m.num_attention_heads) % 2:
        raise ConfigError("model.position_embedding=rope needs an even head dimension "
                          "(model.hidden_size / model.num_attention_heads)")
    _divides("parallel.tensor", par.tensor, "model.ffn_hidden_size", m.ffn_hidden_size)
    ffn_key = "moe.expert_ffn_hidden_size" if moe.expert_ffn_hidden_size else "model.ffn_hidden_size"
    _divides("parallel.expert_shard", par.expert_shard, ffn_key, expert_ffn_hidden_size(cfg))
    if m.bias:  # the experts' output bias b2 [E, h] is sharded over ESP along h (moe/experts.py)
        _divides("parallel.expert_shard", par.expert_shard, "model.hidden_size", m.hidden_size)

    dp = stage_size // par.tensor
    if tr.global_batch_size % (tr.micro_batch_size * dp) != 0:
        raise ConfigError(
            f"training.global_batch_size={tr.global_batch_size} is not divisible by "
            f"training.micro_batch_size*data_parallel={tr.micro_batch_size}*{dp}")
    _check_pipeline(cfg, tr.global_batch_size // (tr.micro_batch_size * dp))
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
    _check_checkpoint(cfg)


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


def _check_pipeline(cfg: Config, micro_batches: int) -> None:
    """Pipeline stages (training/pipeline.py, model/pipeline_stages.py) and the distributed optimizer;
    `micro_batches`: per data-parallel rank and iteration."""
    from megatron_moe.training.pipeline_schedules import PIPELINE_SCHEDULES

    par, layers = cfg.parallel, cfg.model.num_layers
    PIPELINE_SCHEDULES.get(par.pipeline_schedule)
    if par.virtual_stages < 1:
        raise ConfigError(f"parallel.virtual_stages={par.virtual_stages} must be >= 1")
    if par.pipeline_schedule == "interleaved":
        if par.virtual_stages < 2 or par.pipeline < 2:
            raise ConfigError(f"parallel.pipeline_schedule=interleaved needs parallel.pipeline >= 2 and "
                              f"parallel.virtual_stages >= 2 (got {par.pipeline} and {par.virtual_stages})")
        if micro_batches % par.pipeline:
            raise ConfigError(f"parallel.pipeline_schedule=interleaved needs the {micro_batches} micro-batches per "
                              f"data-parallel rank (training.global_batch_size / (training.micro_batch_size * "
                              f"data parallel)) to be divisible by parallel.pipeline={par.pipeline}")
    elif par.virtual_stages != 1:
        raise ConfigError(f"parallel.virtual_stages={par.virtual_stages} needs parallel.pipeline_schedule=interleaved "
                          f"(parallel.pipeline_schedule={par.pipeline_schedule} runs one model chunk per stage)")
    chunks = par.pipeline * par.virtual_stages
    if par.pipeline_layers is None:
        if layers % chunks:
            raise ConfigError(f"model.num_layers={layers} is not divisible by parallel.pipeline*parallel.virtual_stages"
                              f"={par.pipeline}*{par.virtual_stages}; set parallel.pipeline_layers for an uneven split")
    else:
        split = list(par.pipeline_layers)
        if len(split) != chunks or any(n < 1 for n in split) or sum(split) != layers:
            raise ConfigError(f"parallel.pipeline_layers={split} must have parallel.pipeline*parallel.virtual_stages="
                              f"{chunks} entries, each >= 1, summing to model.num_layers={layers}")
    if cfg.optimizer.distributed and cfg.moe.balancer in ("flexmoe", "eplb"):
        raise ConfigError(f"optimizer.distributed=true does not work with moe.balancer={cfg.moe.balancer}: its "
                          "vExperts move AdamW state between ranks, which the distributed optimizer shards")


def _check_checkpoint(cfg: Config) -> None:
    ck = cfg.checkpoint
    if ck.save_interval < 0 or ck.keep_last < 0:
        raise ConfigError("checkpoint.save_interval and checkpoint.keep_last must be >= 0")
    if ck.save_interval > 0 and not ck.dir:
        raise ConfigError(f"checkpoint.save_interval={ck.save_interval} needs checkpoint.dir")
    if ck.load == "auto" and not ck.dir:
        raise ConfigError("checkpoint.load=auto needs checkpoint.dir")
    if ck.load not in (None, "auto"):  # a path: a checkpoint or a root of iter_<k> checkpoints (names only)
        from megatron_moe.training.checkpoint import is_checkpoint_root
        from megatron_moe.training.failures import CheckpointError

        try:
            is_checkpoint_root(ck.load)
        except CheckpointError as exc:
            raise checkpoint_load_error(ck.load, exc) from None


def checkpoint_load_error(load: str, exc: Exception) -> ConfigError:
    """The one-line error for a checkpoint that `checkpoint.load` names but that cannot be resumed."""
    return ConfigError(f"checkpoint.load={load}: {exc}")


def _check_registries(cfg: Config) -> None:
    """Pluggable names must be registered (importing the packages registers their entries)."""
    from megatron_moe.moe.balancers import BALANCERS
    from megatron_moe.moe.schedules import SCHEDULES
    from megatron_moe.training.lr import LR_SCHEDULES

    from megatron_moe.moe.router import GATES

    SCHEDULES.get(cfg.moe.schedule)
    BALANCERS.get(cfg.moe.balancer)
    GATES.get(cfg.moe.gate)
    LR_SCHEDULES.get(cfg.optimizer.lr_schedule)
    if cfg.data.tokenizer.type is not None:
        from megatron_moe.data.tokenizers import TOKENIZERS

        TOKENIZERS.get(cfg.data.tokenizer.type)


def validate_data_config(cfg: Config) -> int:
    """Data rules (they read the tokenizer files and the `.idx` headers, so they run in the entry
    points, not in `validate_config`). Returns the tokenizer's vocabulary size."""
    from megatron_moe.data.blend import parse_blend
    from megatron_moe.data.gpt_dataset import parse_split
    from megatron_moe.data.indexed import IndexedDataset

    d = cfg.data
    try:
        parse_split(d.split)
        if not 0.0 < d.mask_prob < 1.0:
            raise ConfigError(f"data.mask_prob={d.mask_prob} must be in (0, 1)")
        if d.path is None:
            if d.tokenizer.type is not None:
                raise ConfigError("data.tokenizer.type is set but data.path is null: the embedded corpus "
                                  "brings its own tokenizer (set data.path to use yours)")
            if d.embedded_vocab_size < 512:
                raise ConfigError(f"data.embedded_vocab_size={d.embedded_vocab_size} must be >= 512")
            vocab_size, source = d.embedded_vocab_size, "data.embedded_vocab_size"
        else:
            for prefix in parse_blend(d.path)[0]:
                IndexedDataset(prefix)  # O(1): both files exist, header and sizes agree
            if d.tokenizer.type is None:
                raise ConfigError("data.path needs data.tokenizer.type (and its files) to know the vocabulary")
            vocab_size = tokenizer_spec(cfg).build().vocab_size
            source = f"data.tokenizer.type={d.tokenizer.type}"
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc).splitlines()[0]) from None
    if cfg.model.vocab_size < vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                          f"{vocab_size} tokens ({source})")
    return vocab_size


def tokenizer_spec(cfg: Config):
    """`data.tokenizer.*` as a `TokenizerSpec` (the registry checks the type)."""
    from megatron_moe.data.tokenizers import TOKENIZERS, TokenizerSpec

    t = cfg.data.tokenizer
    TOKENIZERS.get(t.type)
    return TokenizerSpec(t.type, t.vocab_file, t.merge_file, t.model)


def _check_parm(cfg: Config) -> None:
    """Parm and balancer options (moe/schedules/parm.py, moe/balancers/): SAA belongs to S2 with an MP
    group (auto picks S1 when parallel.tensor=1, so auto + SAA never runs SAA there); auto's
    pick must agree over TP and ep_esp groups; a given hardware profile must have what the
    configured techniques' models need (without one, they are calibrated at start-up)."""
    from megatron_moe.perf.hardware import load_profile

    moe, profile = cfg.moe, cfg.perf.hardware_profile
    if moe.saa and moe.schedule not in ("s2", "auto"):
        raise ConfigError(f"moe.saa=true needs moe.schedule s2 or auto, not {moe.schedule!r}")
    par = cfg.parallel
    if moe.saa and moe.schedule == "s2" and par.tensor == 1:
        raise ConfigError("moe.saa=true with moe.schedule=s2 needs parallel.tensor > 1: SAA overlaps S2's second "
                          "EP&ESP-AlltoAll with its MP-AllGather, and with parallel.tensor=1 there is no all-gather "
                          "(its N_EP phases would be pure overhead); set moe.saa=false")
    ep_esp = par.expert * par.expert_shard
    if moe.schedule == "auto" and par.tensor % ep_esp and ep_esp % par.tensor:
        # ranks sharing a TP group or an ep_esp group must pick alike (moe/schedules/parm.py)
        raise ConfigError(f"moe.schedule=auto needs parallel.tensor={par.tensor} and parallel.expert*"
                          f"parallel.expert_shard={ep_esp} to divide one another")
    if moe.lancet.defer_wgrad and cfg.training.precision == "bf16":
        raise ConfigError("moe.lancet.defer_wgrad=true and training.precision=bf16 cannot be combined yet: the "
                          "deferred weight gradients are computed in fp32 outside autocast")
    _check_lancet_partitions(cfg)
    if moe.smart_schedule and moe.saa:
        raise ConfigError("moe.smart_schedule=true and moe.saa=true cannot be combined: both reschedule S2's combine")
    if moe.smart_group_size < 1 or par.expert % moe.smart_group_size:
        raise ConfigError(f"moe.smart_group_size={moe.smart_group_size} must be >= 1 and divide "
                          f"parallel.expert={par.expert}")
    if moe.balancer == "fastermoe":
        from megatron_moe.moe.balancers.fastermoe import check_fastermoe_config
        check_fastermoe_config(cfg)
    if not 0 <= moe.fastermoe.min_shadow <= moe.num_experts:
        raise ConfigError(f"moe.fastermoe.min_shadow={moe.fastermoe.min_shadow} must be in [0, moe.num_experts]")
    pp = moe.proprophet
    if moe.balancer == "proprophet":
        from megatron_moe.moe.balancers.proprophet import check_proprophet_config
        check_proprophet_config(cfg)
    for key, value, ok, rule in [("alpha", pp.alpha, pp.alpha >= 0, ">= 0"),
                                 ("plan_interval", pp.plan_interval, pp.plan_interval >= 1, ">= 1"),
                                 ("bottom_k", pp.bottom_k, pp.bottom_k >= 0, ">= 0"),
                                 ("min_replicas", pp.min_replicas, 0 <= pp.min_replicas <= moe.num_experts,
                                  "in [0, moe.num_experts]")]:
        if not ok:
            raise ConfigError(f"moe.proprophet.{key}={value} must be {rule}")
    _check_vexperts(cfg)
    if profile:
        loaded = load_profile(profile)  # ConfigError naming perf.hardware_profile if missing or malformed
        for ops, who in profile_needs(cfg):
            loaded.require(ops, who)


def _check_vexperts(cfg: Config) -> None:
    """FlexMoE / EPLB slots (moe/vexperts.py): enough slots for every expert, sane schedules."""
    moe, ep = cfg.moe, cfg.parallel.expert
    per_rank = moe.num_experts // ep
    fm, eplb = moe.flexmoe, moe.eplb
    if moe.balancer not in ("flexmoe", "eplb"):
        return
    if moe.balancer == "flexmoe":  # each balancer's own section only
        from megatron_moe.moe.balancers.flexmoe_policy import check_flexmoe_config
        check_flexmoe_config(cfg)
        checks = [("flexmoe.slots_per_rank", fm.slots_per_rank,
                   fm.slots_per_rank is None or fm.slots_per_rank >= per_rank,
                   f">= moe.num_experts / parallel.expert = {per_rank} (or null)"),
                  ("flexmoe.interval", fm.interval, fm.interval >= 1, ">= 1"),
                  ("flexmoe.threshold", fm.threshold, fm.threshold >= 1.0, ">= 1.0 (a balance ratio)")]
    else:
        from megatron_moe.moe.balancers.eplb import check_eplb_config
        check_eplb_config(cfg)
        redundant = eplb.redundant_slots if eplb.redundant_slots is not None else (ep if ep > 1 else 0)
        checks = [("eplb.interval", eplb.interval, eplb.interval >= 1, ">= 1"),
                  ("eplb.ema", eplb.ema, 0.0 < eplb.ema <= 1.0, "in (0, 1]"),
                  ("eplb.redundant_slots", eplb.redundant_slots,
                   redundant >= 0 and (moe.num_experts + redundant) % ep == 0
                   and (moe.num_experts + redundant) // ep <= moe.num_experts,
                   f">= 0 with moe.num_experts + it divisible by parallel.expert={ep} and at most "
                   f"moe.num_experts slots per rank (or null = {ep if ep > 1 else 0})")]
    for key, value, ok, rule in checks:
        if not ok:
            raise ConfigError(f"moe.{key}={value} must be {rule}")


def profile_needs(cfg: Config):
    """[(hardware profile ops, the config key=value that needs them)] for `cfg`'s techniques."""
    from megatron_moe.perf.hardware import BALANCER_OPS, LANCET_OPS, PARM_OPS
    from megatron_moe.perf.proprophet_model import PROPROPHET_OPS

    needs = []
    if cfg.moe.schedule == "auto":
        needs.append((PARM_OPS, "moe.schedule=auto"))
    if cfg.moe.balancer in ("fastermoe", "flexmoe"):
        needs.append((BALANCER_OPS, f"moe.balancer={cfg.moe.balancer}"))
    if cfg.moe.balancer == "proprophet":
        needs.append((PROPROPHET_OPS, "moe.balancer=proprophet"))
    if cfg.moe.lancet.defer_wgrad:  # Alg. 1's budget: each backward all-to-all's estimated time
        needs.append((LANCET_OPS, "moe.lancet.defer_wgrad=true"))
    return needs


def _check_lancet_partitions(cfg) -> None:
    """`moe.lancet.partitions` / `partition_range` (moe/lancet_partition.py)."""
    lancet = cfg.moe.lancet
    if lancet.partitions < 1:
        raise ConfigError(f"moe.lancet.partitions={lancet.partitions} must be >= 1 (1 = off)")
    if lancet.partitions > cfg.training.micro_batch_size:
        raise ConfigError(f"moe.lancet.partitions={lancet.partitions} must be <= training.micro_batch_size="
                          f"{cfg.training.micro_batch_size}: each part is at least one sequence")
    rng = str(lancet.partition_range)
    if rng != "auto" and not (rng.isdigit()):
        raise ConfigError(f"moe.lancet.partition_range={rng!r} must be auto or a number of sublayers >= 0")
    if lancet.max_range is not None and (lancet.max_range < 1 or rng != "auto"):
        raise ConfigError(f"moe.lancet.max_range={lancet.max_range} must be >= 1 (or null) and needs "
                          f"moe.lancet.partition_range=auto (got {rng!r}): it bounds the dynamic program's segments")
    if lancet.partitions > 1 and cfg.training.recompute != "none":
        raise ConfigError(f"moe.lancet.partitions>1 and training.recompute={cfg.training.recompute} cannot be "
                          "combined yet: the partitioned forward runs sublayers per batch part, outside the "
                          "recomputed regions and their dropout replay")
    if lancet.partitions > 1 and cfg.moe.gate == "topology":
        raise ConfigError("moe.lancet.partitions>1 and moe.gate=topology cannot be combined: the topology gate's "
                          "budget ranks the whole micro-batch's choices, so batch parts would route differently "
                          "(Lancet §5: such gates allow partitioning only after the MoE layer, not built)")
