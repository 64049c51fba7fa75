"""Resuming: may this run continue from a checkpoint, and what does the resume change
(docs/checkpoints.md, "What a resume may change"). Reads the checkpoint's `config.yaml` and
`meta.json`, never a tensor, so `--check-config` runs it once before any rank starts.

Each config key falls in one class:

* layout (`LAYOUT`): how the same computation is laid out and run (parallel degrees, the
  distributed optimizer, the micro-batch size, schedules and overlap, checkpointing, profiles):
  changes silently (the checkpoint reshards, docs/checkpoints.md);
* architecture (`ARCHITECTURE`): the tensors' shapes and what they mean (`model.seq_length` too
  with learned position embeddings): refused, naming the key;
* tunable (`TUNABLE`): legitimate changes (run length and LR schedule, evaluation, logging,
  precision, balancer, dropout, loss coefficients): one warning line lists them; a changed LR
  schedule adds one line saying how the LR moves (`lr.schedule_change`);
* anything else (data, seed, routing function, ...): `checkpoint.load=auto`, which continues this
  run, refuses it; `checkpoint.load=PATH`, which starts from a checkpoint on purpose (another data
  set, an imported model), lists it with the warning.

`checkpoint.load=auto` also refuses a checkpoint that another `training.run_dir` wrote (a new
experiment never continues another's run), and a checkpoint with optimizer state needs the global
batch size it was trained with (`checkpoint.check_consumed`).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, List, Optional

from megatron_moe.config import Config, ConfigError
from megatron_moe.training.checkpoint import META, checkpoint_config, check_consumed, load_path, read_meta
from megatron_moe.training.failures import CheckpointError
from megatron_moe.training.lr import schedule_change

LAYOUT = ("parallel.", "optimizer.distributed", "training.micro_batch_size", "training.global_batch_size",
          "training.compile", "training.recompute", "training.eval_only", "training.run_dir", "checkpoint.", "perf.",
          "data.cache_dir", "moe.schedule", "moe.token_dispatch", "moe.saa", "moe.lancet.", "moe.smart_schedule",
          "moe.smart_group_size")
ARCHITECTURE = ("model.num_layers", "model.hidden_size", "model.ffn_hidden_size", "model.num_attention_heads",
                "model.num_query_groups", "model.head_dim", "model.qk_norm", "model.qkv_bias", "model.vocab_size",
                "model.normalization", "model.activation", "model.position_embedding", "model.bias",
                "model.tie_embeddings", "model.binary_head", "moe.num_experts", "moe.expert_ffn_hidden_size",
                "moe.layer_freq", "moe.shared_expert_ffn_hidden_size", "moe.shared_expert_gate", "moe.expert_bias",
                "moe.first_k_dense", "moe.layer_pattern", "model.mtp_depth",
                # gpt-oss (model/attention_variants.py, moe/router.py, moe/experts.py)
                "model.attention_output_bias", "model.attention_sinks", "model.sliding_window", "model.layer_types",
                "moe.activation", "moe.swiglu_limit", "moe.router_bias", "moe.expert_proj_bias")
TUNABLE = ("training.train_iters", "training.lr_decay_iters", "training.log_interval", "training.eval_interval",
           "training.eval_iters", "training.on_nonfinite", "training.precision", "training.inject_nan_at",
           "optimizer.", "logging.", "moe.balancer", "moe.fastermoe.", "moe.proprophet.", "moe.flexmoe.", "moe.eplb.",
           "moe.aux_loss_coeff", "moe.z_loss_coeff", "moe.expert_bias_rate", "model.dropout", "training.mtp_loss_weight")
# null keys compared by the value they stand for
EFFECTIVE = {
    "model.num_query_groups": lambda c: c.model.num_query_groups or c.model.num_attention_heads,
    "model.head_dim": lambda c: c.model.head_dim or c.model.hidden_size // c.model.num_attention_heads,
    "model.qkv_bias": lambda c: c.model.bias if c.model.qkv_bias is None else c.model.qkv_bias,
    "model.attention_output_bias": lambda c: (c.model.bias if c.model.attention_output_bias is None
                                              else c.model.attention_output_bias),
    "moe.expert_proj_bias": lambda c: c.model.bias if c.moe.expert_proj_bias is None else c.moe.expert_proj_bias,
    "moe.activation": lambda c: c.moe.activation or c.model.activation,
    "moe.expert_ffn_hidden_size": lambda c: c.moe.expert_ffn_hidden_size or c.model.ffn_hidden_size,
    "moe.norm_topk_prob": lambda c: c.moe.top_k > 1 if c.moe.norm_topk_prob is None else c.moe.norm_topk_prob,
}
SHOWN = 6  # changed keys named in one line


def _matches(key: str, patterns) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in patterns)


def key_class(key: str, cfg: Config) -> str:
    """layout | architecture | tunable | other (module docstring)."""
    if _matches(key, LAYOUT):
        return "layout"
    if _matches(key, ARCHITECTURE) or (key == "model.seq_length" and cfg.model.position_embedding == "learned"):
        return "architecture"
    return "tunable" if _matches(key, TUNABLE) else "other"


def flat(cfg: Config) -> Dict[str, Any]:
    """{dotted key: value} of every leaf, derived null keys filled (`EFFECTIVE`)."""
    out: Dict[str, Any] = {}

    def walk(prefix: str, node) -> None:
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if dataclasses.is_dataclass(value):
                walk(f"{prefix}{f.name}.", value)
            else:
                out[prefix + f.name] = value
    walk("", cfg)
    out.update({key: fn(cfg) for key, fn in EFFECTIVE.items()})
    return out


def _show(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _changes(keys: List[str], old: Dict[str, Any], new: Dict[str, Any]) -> str:
    shown = ", ".join(f"{k} {_show(old[k])} -> {_show(new[k])}" for k in keys[:SHOWN])
    return shown + (f" and {len(keys) - SHOWN} more ({', '.join(keys[SHOWN:])})" if len(keys) > SHOWN else "")


def same_dir(a: str, b: str) -> bool:
    return os.path.normpath(a) == os.path.normpath(b) or os.path.realpath(a) == os.path.realpath(b)


def _read_meta(path: str) -> dict:
    try:
        return read_meta(path)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: cannot read {META} ({exc})") from None


def check_resume(cfg: Config, path: str, meta: Optional[dict] = None) -> List[str]:
    """Raise CheckpointError if `cfg` may not resume the checkpoint at `path` (module docstring);
    return the lines to print: the changed keys, how the LR moves. `meta`: its meta.json, if read."""
    meta = _read_meta(path) if meta is None else meta
    check_consumed(path, meta, cfg)
    try:
        saved = checkpoint_config(path)
    except ConfigError as exc:  # a config of an older version
        return [f"checkpoint: {path}: its config.yaml is not comparable with this run's ({exc})"]
    auto = cfg.checkpoint.load == "auto"
    if auto and not same_dir(saved.training.run_dir, cfg.training.run_dir):
        raise CheckpointError(
            f"{path} belongs to the run in training.run_dir={saved.training.run_dir}, not to this run's "
            f"{cfg.training.run_dir}: a new experiment starts fresh in its own checkpoint.dir (default "
            f"<run_dir>/checkpoints); to start from that checkpoint on purpose, set checkpoint.load={path}")
    old, new = flat(saved), flat(cfg)
    changed = [k for k in new if k in old and old[k] != new[k]]
    kinds = {k: key_class(k, cfg) for k in changed}
    wrong = [k for k in changed if kinds[k] == "architecture"]
    if wrong:
        raise CheckpointError(f"{path} holds another model: {_changes(wrong, old, new)}; the architecture must "
                              "match the checkpoint's (the layout, parallel.*, may change)")
    other = [k for k in changed if kinds[k] == "other"]
    if auto and other:
        raise CheckpointError(
            f"{path} was trained with other settings: {_changes(other, old, new)}; checkpoint.load=auto continues "
            f"the same run: give a changed experiment its own training.run_dir (with checkpoint.load={path} "
            "to start from this checkpoint)")
    notes = []
    listed = [k for k in changed if kinds[k] != "layout"]
    if listed:
        notes.append(f"checkpoint: resuming with changed settings: {_changes(listed, old, new)}")
    lr = schedule_change(saved, cfg, meta["iteration"]) if meta.get("has_optimizer") else None
    return notes + ([lr] if lr else [])


def nothing_to_train(cfg: Config, path: Optional[str], iteration: int) -> Optional[str]:
    """The line for a run that has no iteration to train (None if some are left); `path`: the
    checkpoint it resumed at `iteration` (None: a fresh start)."""
    if cfg.training.eval_only or iteration < cfg.training.train_iters:
        return None
    if path is None:
        return f"nothing to train: training.train_iters={cfg.training.train_iters}"
    return (f"nothing to train: {path} is at iteration {iteration} and training.train_iters="
            f"{cfg.training.train_iters}; raise training.train_iters to train on, or evaluate it with "
            "training.eval_only=true")


def preview_resume(cfg: Config) -> List[str]:
    """`--check-config`: the lines about the checkpoint this config resumes (CheckpointError if it may
    not), found by names only (`load_path(verify=False)`: the ranks verify its files when they load it)."""
    path = load_path(cfg, verify=False)
    if path is None:
        return []
    meta = _read_meta(path)
    notes = check_resume(cfg, path, meta)
    iteration = meta["iteration"]
    idle = nothing_to_train(cfg, path, iteration)
    return [f"resumes from {path} (iteration {iteration})"] + notes + ([idle] if idle else [])
