"""Offline checkpoint conversions on one process (`tools/convert_checkpoint.py`, docs/checkpoints.md).

* `reshard`: rewrite a checkpoint with the chunks of another (tensor, expert, expert_shard)
  layout, so each rank of the new layout reads exactly its own chunk (any layout can also load
  any checkpoint directly; resharding offline just moves the work out of the job start);
* `consolidate`: every global tensor in one safetensors file (+ meta and config as text);
* `upcycle`: sparse upcycling (Komatsuzaki et al. 2023, §3.1): every expert of every layer starts
  as that layer's dense FFN, the router as initialized from the seed; with top-k weights that sum
  to one (`moe.norm_topk_prob`, or top_k >= 2 by default) the MoE model computes exactly the
  dense model's function;
* `export_hf` / `import_hf`: Hugging Face Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE (`convert/hf_common.py`), gpt-oss
  (`convert/hf_gpt_oss.py`, MXFP4 experts dequantized on import), DeepSeek-V3 (+ Kimi K2 on import) and
  GLM-4.5 (`convert/hf_deepseek.py`, FP8 weights dequantized on import);
  export streams layer by layer into safetensors shards, import reads tensors lazily; import also
  takes dense Llama, Mistral and Qwen3 (`convert/hf_dense.py`), as they are or upcycled;
* `upgrade_swiglu`: checkpoints written before SwiGLU's (gate, up) halves layout (issue #16).

Outputs are never written in place: each conversion writes a fresh directory beside `--output` and
swaps it in when complete (`replace_output`), so no file of an older output (an earlier
checkpoint, a stale shard) survives, and a failed conversion leaves the old output untouched. A
non-empty output is refused unless `force` (export_hf: unless it holds an earlier export of ours).

Conversions work on full global tensors, so they need host memory for the whole checkpoint
(`export_hf`: one layer's plus one output shard's).
Parameter identities (global shape, sharding) come from building the single-process model.
The checkpoint's `tokenizer/` copy is kept by `reshard`, `upgrade_swiglu` and `upcycle`; export_hf
writes it as Hugging Face tokenizer files and import_hf copies an HF directory's
(`convert/hf_tokenizer.py`); `consolidate`'s single file holds none.
RNG states are dropped (they belong to ranks of the old layout); AdamW moments, step counts,
iteration and consumed samples are kept by `reshard`; `upcycle` and `import_hf` start a fresh
optimizer at iteration 0.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from megatron_moe.config import Config, load_config, validate_config
from megatron_moe.config.load import to_yaml
from megatron_moe.distributed.parallel_state import ParallelState, RankLayout
from megatron_moe.inference import build_single_process_model
from megatron_moe.training.checkpoint import (checkpoint_config, checkpoint_tokenizer_dir, layout_dict, read_meta,
                                              resolve_checkpoint, single_process_config, write_checkpoint_dir,
                                              NO_PIPELINE)
from megatron_moe.training.checkpoint_files import ShardedEntry, full_entry, interleaved_swiglu_dim
from megatron_moe.training.checkpoint_io import load_full, read_metadata

SINGLE = ["parallel.tensor=1", "parallel.expert=1", "parallel.expert_shard=1", "parallel.pipeline=1",
          "checkpoint.load=null"]


def read_checkpoint(path: str, prefix: str = "") -> Tuple[str, dict, Dict[str, torch.Tensor]]:
    """(verified checkpoint dir, meta.json, full global tensors whose keys start with `prefix`)."""
    path = resolve_checkpoint(path)
    keys = [k for k in read_metadata(path).state_dict_metadata if k.startswith(prefix)]
    return path, read_meta(path), load_full(path, keys)


def model_weights(path: str) -> Tuple[str, Dict[str, torch.Tensor]]:
    path, _, tensors = read_checkpoint(path, "model/")
    return path, {k[len("model/"):]: v for k, v in tensors.items()}


def _param_of(key: str) -> str:
    """`model/<name>` or `optim/<name>/<field>` -> <name>."""
    return key[len("model/"):] if key.startswith("model/") else key[len("optim/"):].rsplit("/", 1)[0]


# -- outputs --------------------------------------------------------------------------------------
def check_output(out: str, force: bool, inputs: Tuple[str, ...] = (),
                 replaceable: Optional[Callable[[str], bool]] = None) -> None:
    """Refuse (one line) an output that overlaps an input, or that is not empty, unless `force` or
    `replaceable(out)` (an earlier output of the same kind, which is replaced)."""
    real = os.path.realpath(out)
    for source in inputs:
        src = os.path.realpath(source)
        if real == src or os.path.commonpath([real, src]) in (real, src):
            raise ValueError(f"--output {out} overlaps --input {source}: choose another output")
    if not os.path.lexists(out) or force or (os.path.isdir(out) and not os.listdir(out)):
        return
    if os.path.isdir(out) and replaceable is not None and replaceable(out):
        return
    held = sorted(os.listdir(out)) if os.path.isdir(out) else []
    kind = "a checkpoint" if any(n.startswith("iter_") or n == "latest" for n in held) or \
        os.path.isfile(os.path.join(out, "meta.json")) else "files" if held else "a file"
    what = f" ({', '.join(held[:3])}{f' and {len(held) - 3} more' if len(held) > 3 else ''})" if held else ""
    raise ValueError(f"--output {out} already holds {kind}{what}; pass --force to replace it")


@contextmanager
def replace_output(out: str) -> Iterator[str]:
    """A fresh directory beside `out` to write into; when the block completes it takes `out`'s
    place (two renames; the old output is then deleted), when it raises it is deleted."""
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.partial-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would make the output owner-only, unlike makedirs
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = tmp + "-old"
    if os.path.lexists(out):
        os.rename(out, old)
    os.rename(tmp, out)
    if os.path.lexists(old):
        shutil.rmtree(old) if os.path.isdir(old) and not os.path.islink(old) else os.remove(old)


def _write_root(out_root: str, force: bool, write: Callable[[str], str]) -> str:
    """`write(root)` (a checkpoint writer returning its iter_* directory) into a fresh root that
    replaces `out_root`; the iter_* directory's final path."""
    check_output(out_root, force)
    with replace_output(out_root) as tmp:
        written = os.path.relpath(write(tmp), tmp)
    return os.path.join(out_root, written)


def write_model_checkpoint(out_root: str, cfg: Config, weights: Dict[str, torch.Tensor], force: bool = False,
                           tokenizer=None) -> str:
    """Weights (param name -> full tensor) as a checkpoint at iteration 0 without optimizer state,
    replacing `out_root` (a non-empty one only with `force`); `tokenizer` as write_checkpoint_dir takes it."""
    model = build_single_process_model(cfg)
    expected = {name: p for name, p in model.named_parameters()}
    if set(weights) != set(expected):
        missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
        raise ValueError(f"weights do not match the model: missing {missing[:3]}, unexpected {extra[:3]}")
    entries = {}
    for name, tensor in weights.items():
        meta = expected[name].meta
        shape = (meta.valid_rows,) + tuple(meta.global_shape[1:]) if meta.valid_rows else tuple(meta.global_shape)
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, the model expects {shape}")
        entries[f"model/{name}"] = full_entry(tensor.to(torch.float32).contiguous())
    meta = {"iteration": 0, "consumed_samples": 0, "layout": layout_dict(ParallelState.single_process()),
            "has_optimizer": False, "trainer": {}}
    return _write_root(out_root, force, lambda root: write_checkpoint_dir(root, 0, entries, meta, to_yaml(cfg), None,
                                                                          tokenizer=tokenizer))


# -- reshard / consolidate ------------------------------------------------------------------------
def reshard(path: str, out_root: str, tensor: int, expert: int, expert_shard: int, force: bool = False) -> str:
    """Rewrite checkpoint `path` with the chunks of layout (tensor, expert, expert_shard)."""
    check_output(out_root, force, (path,))
    path, meta, tensors = read_checkpoint(path)
    return _write_layout(path, out_root, meta, tensors, tensor, expert, expert_shard, force)


def _write_layout(path: str, out_root: str, meta: dict, tensors: Dict[str, torch.Tensor], tensor: int, expert: int,
                  expert_shard: int, force: bool = False) -> str:
    """Full global tensors of checkpoint `path` -> a checkpoint under `out_root` whose chunks are
    those of layout (tensor, expert, expert_shard)."""
    world = math.lcm(tensor, expert * expert_shard)
    cfg = checkpoint_config(path, [f"parallel.tensor={tensor}", f"parallel.expert={expert}",
                                   f"parallel.expert_shard={expert_shard}", "checkpoint.load=null"] + NO_PIPELINE)
    validate_config(cfg, world)
    layout = RankLayout(world_size=world, tensor=tensor, expert=expert, expert_shard=expert_shard)
    states = [ParallelState.build(layout, r) for r in range(world)]
    metas = {name: p.meta for name, p in build_single_process_model(single_process_config(path)).named_parameters()}
    entries: Dict[str, ShardedEntry] = {}
    for key, full in tensors.items():
        if key.startswith("rng/"):
            continue  # per-rank streams of the old layout
        if key.endswith("/step"):
            entries[key] = full_entry(full)
            continue
        pmeta, chunks = metas[_param_of(key)], {}
        for state in states:
            offsets = pmeta.offsets(state)
            sizes = list(pmeta.local_shape(state))
            sizes[0] = min(sizes[0], full.shape[0] - offsets[0])  # cut padded vocabulary rows
            if sizes[0] > 0:
                index = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
                chunks[tuple(offsets)] = full[index].contiguous()
        entries[key] = ShardedEntry(tuple(full.shape), [(t, o) for o, t in chunks.items()])
    new_meta = dict(meta, layout=layout_dict(states[0]))
    new_meta.pop("balancers", None)  # vExpert slots of the old layout: the new one starts from the owners'

    return _write_root(out_root, force, lambda root: write_checkpoint_dir(root, meta["iteration"], entries, new_meta,
                                                                          to_yaml(cfg), None,
                                                                          tokenizer=checkpoint_tokenizer_dir(path)))


# -- SwiGLU layout upgrade -------------------------------------------------------------------------
def halves_from_interleaved(old: torch.Tensor, new_shape) -> Optional[torch.Tensor]:
    """A SwiGLU tensor saved before the (gate, up) halves layout (`model/mlp.py`): its units were
    one dimension of 2f with gate/up interleaved ([f, 2] order). If `old` is that form of a
    tensor of `new_shape` (a dimension of size 2 followed by f), return it in the new layout;
    else None."""
    k = interleaved_swiglu_dim(old.shape, new_shape)
    if k is None:
        return None
    return old.unflatten(k, (new_shape[k + 1], 2)).transpose(k, k + 1).contiguous()


def upgrade_swiglu(path: str, out_root: str, force: bool = False) -> str:
    """Rewrite a checkpoint whose SwiGLU weights (dense fc1, experts' w1 / b1, and their AdamW
    moments) are in the old interleaved layout into the (gate, up) halves layout, keeping its
    iteration, optimizer state and parallel layout."""
    check_output(out_root, force, (path,))
    path, meta, tensors = read_checkpoint(path)
    metas = {name: p.meta for name, p in build_single_process_model(single_process_config(path)).named_parameters()}
    converted = 0
    for key, tensor in tensors.items():
        if key.startswith(("model/", "optim/")) and not key.endswith("/step"):
            new = halves_from_interleaved(tensor, metas[_param_of(key)].global_shape)
            if new is not None:
                tensors[key], converted = new, converted + 1
    if not converted:
        raise ValueError(f"{path} has no SwiGLU tensor in the interleaved layout: nothing to upgrade")
    layout = meta["layout"]
    return _write_layout(path, out_root, meta, tensors, layout["tensor"], layout["expert"], layout["expert_shard"],
                         force)


def consolidate(path: str, out_file: str) -> None:
    """Every global tensor of checkpoint `path` in one safetensors file; meta.json and the config
    ride along as text in the file's metadata."""
    from safetensors.torch import save_file

    path, meta, tensors = read_checkpoint(path)
    tensors = {k: v.contiguous() for k, v in tensors.items() if not k.startswith("rng/")}
    save_file(tensors, out_file, metadata={"meta": json.dumps(meta), "config": to_yaml(checkpoint_config(path))})


# -- upcycling ----------------------------------------------------------------------------------
# dense FFN param -> (expert param, one expert's slice): fc1 [(2,) f, h] -> w1[e] [h, (2,) f],
# fc2 [h, f] -> w2[e] [f, h]
_UPCYCLE = {"fc1.weight": ("w1", lambda t: t.movedim(-1, 0)), "fc1.bias": ("b1", lambda t: t),
            "fc2.weight": ("w2", torch.t), "fc2.bias": ("b2", lambda t: t)}


def upcycle(path: str, num_experts: int, out_root: str, top_k: Optional[int] = None, force: bool = False) -> str:
    """Dense checkpoint -> MoE checkpoint with `num_experts` copies of each layer's FFN (every layer
    MoE), `top_k` experts per token (default: the checkpoint's `moe.top_k`)."""
    check_output(out_root, force, (path,))
    path, dense = model_weights(path)
    cfg = checkpoint_config(path, SINGLE)
    moe_layers = [i for i in range(cfg.model.num_layers) if f"layers.{i}.ffn.router.weight" in dense]
    if moe_layers:
        raise ValueError(f"upcycle needs a dense checkpoint (moe.layer_freq > model.num_layers); "
                         f"layer {moe_layers[0]} is already MoE")
    target = checkpoint_config(path, SINGLE + upcycle_overrides(cfg, num_experts, top_k))
    return write_model_checkpoint(out_root, target, upcycle_weights(dense, target), force,
                                  checkpoint_tokenizer_dir(path))


def upcycle_overrides(dense: Config, num_experts: int, top_k: Optional[int] = None) -> List[str]:
    """What turns the dense model's config into the upcycled one's: `num_experts` experts of the
    dense FFN's width in every layer, `top_k` of them per token (None: `moe.top_k` as it is)."""
    out = [f"moe.num_experts={num_experts}", "moe.layer_freq=1",
           f"moe.expert_ffn_hidden_size={dense.model.ffn_hidden_size}"]
    return out + ([] if top_k is None else [f"moe.top_k={top_k}"])


def upcycle_weights(dense: Dict[str, torch.Tensor], target: Config) -> Dict[str, torch.Tensor]:
    """The dense model's weights -> the upcycled model's (`target`): every expert of layer i = layer
    i's FFN, the routers as the model initializes them from the seed, the rest unchanged."""
    from megatron_moe.config.validate import expert_activation, expert_proj_bias

    if target.moe.top_k > target.moe.num_experts:
        raise ValueError(f"--num-experts {target.moe.num_experts} is smaller than moe.top_k={target.moe.top_k}")
    m = target.model
    if expert_activation(target) != m.activation or expert_proj_bias(target) != m.bias:  # copies would compute another function
        raise ValueError(f"upcycling copies the dense FFN into the experts, which needs the experts' activation and biases "
                         f"to be the dense FFN's: moe.activation={target.moe.activation} and moe.expert_proj_bias="
                         f"{target.moe.expert_proj_bias} against model.activation={m.activation}, model.bias={m.bias}")
    routers = {name: p.detach() for name, p in build_single_process_model(target).named_parameters()
               if ".ffn.router." in name}  # router weights (and expert biases, zero) as initialized
    weights = {}
    for name, tensor in dense.items():
        prefix, _, leaf = name.partition(".ffn.")
        if not leaf or f"{prefix}.ffn.router.weight" not in routers:  # not an FFN, or one that stays dense
            weights[name] = tensor  # (moe.first_k_dense)
            continue
        expert_name, per_expert = _UPCYCLE[leaf]
        weights[f"{prefix}.ffn.experts.{expert_name}"] = per_expert(tensor).unsqueeze(0).expand(
            target.moe.num_experts, *per_expert(tensor).shape).contiguous()
        weights.update({k: v for k, v in routers.items() if k.startswith(f"{prefix}.ffn.router.")})
    return weights


# -- Hugging Face -------------------------------------------------------------------------------
def guess_family(cfg: Config) -> str:
    """The HF family our config's shape names: QK-norm head -> qwen3_moe, full -> olmoe, a shared
    expert -> qwen2_moe, else mixtral; attention sinks -> gpt_oss; multi-head latent attention ->
    deepseek_v3, sigmoid scores (standard attention) -> glm4_moe."""
    if cfg.model.attention_sinks:
        return "gpt_oss"
    if cfg.model.attention == "mla":
        return "deepseek_v3"
    if cfg.moe.score_function == "sigmoid":
        return "glm4_moe"
    if cfg.model.qk_norm == "head":
        return "qwen3_moe"
    if cfg.model.qk_norm == "full":
        return "olmoe"
    return "qwen2_moe" if cfg.moe.shared_expert_ffn_hidden_size else "mixtral"


def export_hf(path: str, out_dir: str, family: Optional[str] = None, max_shard_bytes: int = 5 << 30,
              precision: Optional[str] = None, force: bool = False) -> None:
    """Checkpoint (any layout) -> HF directory of `family` (default: `guess_family`), streamed one
    layer's global tensors at a time into safetensors shards + index (convert/hf_common.py), with
    weights in `precision` (fp32 | bf16; default: the run's `training.precision`). Checkpoints hold
    fp32 weights (a bf16 run's masters), so either dtype is exported from the fp32 values, rounded
    once for bf16. Written into a fresh directory that replaces `out_dir`: an empty one, an earlier
    export of ours (`hf_common.is_export`), or with `force` anything."""
    from megatron_moe.convert import hf_common as H
    from megatron_moe.convert.hf_families import family_of
    from megatron_moe.convert.hf_tokenizer import export_tokenizer
    from megatron_moe.model.precision import PARAM_DTYPES

    check_output(out_dir, force, (path,), H.is_export)
    path = resolve_checkpoint(path)
    cfg = checkpoint_config(path, SINGLE)
    fam = family_of(family or guess_family(cfg))
    H.check_shape(fam, cfg)
    precision = precision or cfg.training.precision
    if precision not in PARAM_DTYPES:
        raise ValueError(f"export-hf --precision {precision}: expected one of {sorted(PARAM_DTYPES)}")
    keys = [k for k in read_metadata(path).state_dict_metadata if k.startswith("model/")]

    def load(keep) -> Dict[str, torch.Tensor]:
        return {k[len("model/"):]: v for k, v in load_full(path, [k for k in keys if keep(k)]).items()}

    with replace_output(out_dir) as tmp:
        H.write_hf(tmp, fam, cfg, load(lambda k: not k.startswith(("model/layers.", "model/mtp."))),
                   lambda i: load(lambda k: k.startswith(f"model/layers.{i}.")), max_shard_bytes,
                   PARAM_DTYPES[precision], lambda d: load(lambda k: k.startswith(f"model/mtp.{d}.")))
        missing = export_tokenizer(path, tmp, cfg.model.seq_length)
    if missing:
        print(f"export-hf: no tokenizer written: {missing}", file=sys.stderr)


def import_hf(hf_dir: str, out_root: str, base_config: str = None, overrides: List[str] = (),
              num_experts: Optional[int] = None, top_k: Optional[int] = None, force: bool = False,
              allow_unused: bool = False) -> str:
    """HF directory (family from its config.json) -> our checkpoint; training settings from
    `base_config` (+ overrides). A dense family (hf_dense.py) gives our dense model, or, with
    `num_experts`, that model upcycled (`upcycle_weights`, `top_k` experts per token) into the
    shape of the MoE family it names. A tensor the model does not use (the config decides what is
    read) is refused by name, or with `allow_unused` listed on stderr and skipped; a key of
    config.json or a tensor that is missing is named as HF names it."""
    from megatron_moe.convert import hf_common as H
    from megatron_moe.convert.hf_dense import DenseFamily
    from megatron_moe.convert.hf_families import family_of, import_family_of
    from megatron_moe.convert.hf_tokenizer import import_tokenizer
    from megatron_moe.model.transformer import moe_layer_flags

    check_output(out_root, force, (hf_dir,))
    reader = H.HFReader(hf_dir)
    fam = import_family_of(reader.config["model_type"])
    if num_experts is not None and not isinstance(fam, DenseFamily):
        raise ValueError(f"--num-experts upcycles a dense model; {fam.architecture} is already MoE")
    cfg = load_config(base_config, H.import_overrides(fam, reader) + SINGLE + list(overrides))
    H.check_shape(fam, cfg)
    weights = H.outer_from_hf(cfg, reader.get)
    if cfg.model.tie_embeddings and reader.has("lm_head.weight") and \
            torch.equal(reader.get("lm_head.weight", use=False), weights["embedding.word.weight"]):
        reader.used.add("lm_head.weight")  # a stored copy of the tied embedding
    for i, is_moe in enumerate(moe_layer_flags(cfg)[:cfg.model.num_layers]):
        weights.update(H.layer_from_hf(fam, cfg, reader.get, i, is_moe, reader.config))
    weights.update(H.mtp_from_hf(fam, cfg, reader))  # multi-token prediction modules (hf_deepseek.py)
    unused = reader.unused()
    what = f"{len(unused)} tensor{'s' if len(unused) > 1 else ''} the model does not use"
    if unused and not allow_unused:
        more = f" and {len(unused) - 4} more" if len(unused) > 4 else ""
        raise ValueError(f"{hf_dir} has {what}: {', '.join(unused[:4])}{more}; pass --allow-unused to skip them")
    if unused:
        print(f"warning: skipping {what}: {', '.join(unused)}", file=sys.stderr)
    if num_experts is not None:
        cfg = load_config(base_config, H.import_overrides(fam, reader) + SINGLE + list(overrides)
                          + upcycle_overrides(cfg, num_experts, top_k))
        H.check_shape(family_of(fam.upcycles_to), cfg)
        weights = upcycle_weights(weights, cfg)
    return write_model_checkpoint(out_root, cfg, weights, force, import_tokenizer(hf_dir))
