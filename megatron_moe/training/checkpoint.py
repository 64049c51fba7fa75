"""Training checkpoints: what is saved, where, and how a run resumes (docs/checkpoints.md).

A checkpoint is a directory `<checkpoint.dir>/iter_<iteration:07d>/` (`checkpoint.dir` null =
`<training.run_dir>/checkpoints`: each run its own) holding

* DCP tensor files (`checkpoint_io.py`, imported on the first save or load), every tensor under its global identity:
  `model/<param name>` (global shape + each rank's shard offsets from `ParamMeta`; names are the
  same under any pipeline split, model/pipeline_stages.py, each stage writes its own),
  (fp32 always: a bf16 run saves its fp32 master weights, training/mixed_precision.py, and loads
  them back into its masters, so fp32 and bf16 runs resume each other's checkpoints),
  `optim/<param name>/exp_avg|exp_avg_sq` (AdamW moments share their parameter's sharding, so
  they reshard with it; a distributed optimizer writes its shards' parts as boxes of the same
  tensors), `optim/<param name>/step` (replicated scalar),
  `rng/rank<r>/...` (torch CPU/CUDA generator and `DropoutRNG` states of rank r);
* `meta.json`: iteration, consumed samples, the layout it was saved under, and (FlexMoE / EPLB)
  `balancers`: each MoE layer's vExpert slots and planner state, restored on the same layout,
  balancer and slot count (the tensors hold one copy per expert whatever the slots hold);
* `config.yaml`: the resolved config;
* `tokenizer/`: a copy of the training tokenizer's files + `tokenizer_spec.json` (its type; the
  embedded corpus's trained BPE too), so the directory is self-contained
  (`training/checkpoint_tokenizer.py` `load_checkpoint_tokenizer`); absent when the datasets used none;
* `manifest.json`: sizes + SHA-256 of all the above, written last.

Replicated tensors are written once (DCP de-duplicates identical chunks). Padded vocabulary rows
(`ParamMeta.valid_rows`) are not saved, so the padded size (which depends on the tensor degree)
never reaches the checkpoint.

Crash safety: everything is written into `iter_<k>.tmp/`, the manifest last; then the directory is
renamed into place, the `latest` pointer file replaced atomically, and only then are old
checkpoints beyond `checkpoint.keep_last` pruned. A kill at any moment leaves the previous
checkpoint complete; a leftover `.tmp` is ignored and removed by the next save.

Resume: the LR schedule and the data position are functions of the iteration (`training/lr.py`,
`data/batches.py`), so iteration + weights + AdamW moments + RNG states give bitwise the same
continuation on the same layout. On a different layout the per-rank RNG streams do not map onto
the new ranks: they are left at their fresh seeds (dropout masks then differ; with dropout 0
the continuation matches to float rounding).
"""
from __future__ import annotations

import os
import re
import shutil
from typing import Dict, List, Optional

import torch

from megatron_moe.config import Config
from megatron_moe.config.load import load_config, to_yaml
from megatron_moe.data.tokenizers import CHECKPOINT_TOKENIZER, training_tokenizer, write_checkpoint_tokenizer
from megatron_moe.distributed import collectives
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.moe.vexpert_moves import fit_optimizer_rows
from megatron_moe.training.distributed_optimizer import DistributedOptimizer
from megatron_moe.training.checkpoint_files import (DCP_METADATA, MANIFEST, ShardedEntry, full_entry, read_json,
                                                    verify_manifest, write_json, write_manifest)
from megatron_moe.training.failures import CheckpointError
from megatron_moe.config.errors import ConfigError
from megatron_moe.config.validate import section_check

LATEST = "latest"
META = "meta.json"
CONFIG = "config.yaml"
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def checkpoint_dir(cfg: Config) -> str:
    """Where the run saves its checkpoints (and `checkpoint.load=auto` looks): `checkpoint.dir`,
    null = `<training.run_dir>/checkpoints`."""
    return cfg.checkpoint.dir or os.path.join(cfg.training.run_dir, "checkpoints")


# -- state entries ------------------------------------------------------------------------------
def param_entry(tensor: Optional[torch.Tensor], meta, state: ParallelState, rows=None, boxes=None) -> ShardedEntry:
    """This rank's shard of a parameter-shaped tensor under its global identity (padding rows cut).
    `rows`: [(local row, global expert)] of a vExpert slot stack (`moe/vexperts.py`), one chunk each.
    `boxes`: [(tensor, offsets inside the local shard)] instead of the whole `tensor` (the
    distributed optimizer's part of the moments, training/distributed_optimizer.py)."""
    shape, offsets = list(meta.global_shape), meta.offsets(state)
    if rows is not None:
        return ShardedEntry(tuple(shape), [(tensor.data[k: k + 1], (e,) + tuple(offsets[1:])) for k, e in rows])
    if meta.valid_rows is not None:
        shape[0] = meta.valid_rows
    chunks = []
    for chunk, local in (boxes if boxes is not None else [(tensor.data, (0,) * tensor.dim())]):
        start = tuple(o + n for o, n in zip(offsets, local))
        if meta.valid_rows is not None:
            chunk = chunk[: max(0, min(chunk.shape[0], meta.valid_rows - start[0]))]
        if chunk.dim() == 0 or chunk.shape[0] > 0:
            chunks.append((chunk, start))
    return ShardedEntry(tuple(shape), chunks)


def model_entries(model: torch.nn.Module, state: ParallelState, masters=None) -> Dict[str, ShardedEntry]:
    """`model/<name>` entries: the parameters, or in bf16 runs their fp32 masters (`masters`: name ->
    a tensor of the parameter's shape, or [(box, offsets)] of a distributed optimizer's shard), so
    a checkpoint holds fp32 weights whatever the run's precision."""
    masters = masters or {}
    out = {}
    for name, p in model.named_parameters():
        master = masters.get(name)
        if isinstance(master, list):
            out[f"model/{name}"] = param_entry(None, p.meta, state, boxes=master)
        else:
            out[f"model/{name}"] = param_entry(p if master is None else master, p.meta, state, _rows(p))
    return out


def master_weights(model: torch.nn.Module, optimizer, adam_states=None) -> Dict[str, object]:
    """name -> fp32 master weights of bf16 parameters (training/mixed_precision.py; the distributed
    optimizer's: boxes of its master shards); empty in fp32 runs. `adam_states`: the per-name
    tensors a load fills instead of the live state."""
    if optimizer is None:
        return {}
    if isinstance(optimizer, DistributedOptimizer):
        return {name: st["master"] for name, st in optimizer.sharded_states().items() if "master" in st}
    if adam_states is not None:
        return {name: st["master"] for name, st in adam_states.items() if "master" in st}
    return {name: optimizer.state[p]["master"] for name, p in model.named_parameters()
            if "master" in optimizer.state.get(p, {})}


def _rows(p: torch.nn.Parameter):
    return p.expert_rows() if hasattr(p, "expert_rows") else None


def _adam_state(optimizer: torch.optim.Optimizer, p: torch.nn.Parameter) -> Dict[str, torch.Tensor]:
    st = optimizer.state.get(p, {})
    return {"exp_avg": st.get("exp_avg", torch.zeros_like(p)), "exp_avg_sq": st.get("exp_avg_sq", torch.zeros_like(p)),
            "step": torch.as_tensor(st.get("step", 0.0), dtype=torch.float32).reshape(())}


def trained_parameters(model: torch.nn.Module):
    """(name, parameter) of the parameters the optimizer steps: frozen ones (the expert bias,
    moe/expert_bias.py) have no AdamW state nor master; the model entries save them as they are."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def optimizer_entries(model: torch.nn.Module, optimizer, state: ParallelState,
                      adam_states: Optional[Dict[str, Dict[str, torch.Tensor]]] = None) -> Dict[str, ShardedEntry]:
    """AdamW state per parameter name; `adam_states` (name -> tensors) overrides the live state.
    A distributed optimizer offers its shards' parts (views: loading fills them)."""
    sharded = optimizer.sharded_states() if isinstance(optimizer, DistributedOptimizer) else None
    out = {}
    for name, p in trained_parameters(model):
        if sharded is not None:
            st = sharded[name]
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"optim/{name}/{key}"] = param_entry(None, p.meta, state, boxes=st[key])
        else:
            st = adam_states[name] if adam_states is not None else _adam_state(optimizer, p)
            out[f"optim/{name}/exp_avg"] = param_entry(st["exp_avg"], p.meta, state, _rows(p))
            out[f"optim/{name}/exp_avg_sq"] = param_entry(st["exp_avg_sq"], p.meta, state, _rows(p))
        out[f"optim/{name}/step"] = full_entry(st["step"])
    return out


def _rng_states(model: torch.nn.Module, state: ParallelState) -> Dict[str, torch.Tensor]:
    prefix = f"rng/rank{state.rank}/"
    out = {prefix + "torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out[prefix + "torch_cuda"] = torch.cuda.get_rng_state()
    rng = getattr(model, "dropout_rng", None)
    if rng is not None:
        out.update({prefix + f"dropout/{key}": value for key, value in rng.state_dict().items()})
    return out


def _set_rng_states(model: torch.nn.Module, state: ParallelState, states: Dict[str, torch.Tensor]) -> None:
    prefix = f"rng/rank{state.rank}/"
    if prefix + "torch_cpu" in states:
        torch.set_rng_state(states[prefix + "torch_cpu"])
    if prefix + "torch_cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states[prefix + "torch_cuda"])
    dropout = {k[len(prefix + "dropout/"):]: v for k, v in states.items() if k.startswith(prefix + "dropout/")}
    if dropout:
        model.dropout_rng.load_state_dict(dropout)


def layout_dict(state: ParallelState) -> Dict[str, int]:
    lay = state.layout
    return {"world_size": lay.world_size, "tensor": lay.tensor, "pipeline": lay.pipeline,
            "expert": lay.expert, "expert_shard": lay.expert_shard}


# -- save ---------------------------------------------------------------------------------------
def write_checkpoint_dir(root: str, iteration: int, entries: Dict[str, ShardedEntry], meta: dict, config_yaml: str,
                         state: Optional[ParallelState], keep_last: int = 0, tokenizer=None) -> str:
    """Collective (one process when `state` is None): write `entries` + metadata crash-safely as
    `root/iter_<iteration>`; return its path. `tokenizer`: a TokenizerSpec or another checkpoint's
    `tokenizer/` directory, copied into `tokenizer/` (data/tokenizers.py; None: none).

    tmp dir -> DCP files -> meta.json, config.yaml -> manifest.json -> rename -> `latest` -> prune."""
    final = iteration_dir(root, iteration)
    tmp = final + ".tmp"
    writer = state is None or state.rank == 0
    if os.path.isdir(final):  # e.g. a SIGTERM save right after the periodic one: already complete
        return final
    if writer:
        os.makedirs(root, exist_ok=True)
        for name in os.listdir(root):  # leftovers of saves that were killed
            if name.endswith(".tmp"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        os.makedirs(tmp)
    _barrier(state)
    from megatron_moe.training import checkpoint_io  # DCP: imported when first needed (~1 s per process)
    checkpoint_io.save_entries(entries, tmp, single_process=state is None)
    _barrier(state)
    if writer:
        write_json(os.path.join(tmp, META), meta)
        with open(os.path.join(tmp, CONFIG), "w") as f:
            f.write(config_yaml)
        if tokenizer is not None:
            write_checkpoint_tokenizer(tokenizer, os.path.join(tmp, CHECKPOINT_TOKENIZER))
        write_manifest(tmp)
        _fsync_dir(tmp)
        os.rename(tmp, final)
        with open(os.path.join(root, LATEST + ".tmp"), "w") as f:
            f.write(os.path.basename(final) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(os.path.join(root, LATEST + ".tmp"), os.path.join(root, LATEST))
        _fsync_dir(root)
        if keep_last > 0:
            for old in checkpoint_dirs(root)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier(state)
    return final


def save_checkpoint(cfg: Config, state: ParallelState, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    iteration: int, trainer_state: Optional[dict] = None) -> str:
    """Collective: save the full training state after `iteration` under `checkpoint_dir(cfg)`
    (`trainer_state`: plain JSON counters of the trainer, returned as meta["trainer"] on load)."""
    for layer in (model.moe_layers() if hasattr(model, "moe_layers") else []):
        layer.balancer.complete_moves()  # best-effort vExpert moves in flight land first
    entries = {**model_entries(model, state, master_weights(model, optimizer)),
               **optimizer_entries(model, optimizer, state)}
    entries.update({k: full_entry(v) for k, v in _rng_states(model, state).items()})
    meta = {"iteration": iteration, "consumed_samples": iteration * cfg.training.global_batch_size,
            "layout": layout_dict(state), "has_optimizer": True, "trainer": trainer_state or {}}
    balancers = _balancer_states(model, state)
    if balancers:
        meta["balancers"] = {"balancer": cfg.moe.balancer, "layout": layout_dict(state), "layers": balancers}
    return write_checkpoint_dir(checkpoint_dir(cfg), iteration, entries, meta, to_yaml(cfg), state,
                                cfg.checkpoint.keep_last, training_tokenizer(cfg))


def _barrier(state: Optional[ParallelState]) -> None:
    if state is not None and collectives.is_initialized():
        collectives.barrier(state.world)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- find ---------------------------------------------------------------------------------------
def checkpoint_dirs(root: str) -> List[str]:
    """Renamed-into-place checkpoint directories under `root`, oldest first."""
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(root) if (m := _ITER_DIR.match(name))]
    return [os.path.join(root, name) for _, name in sorted(found)]


def _verify(path: str, verify: bool) -> None:
    """`verify_manifest`, or with `verify=False` (names only) that the save finished: its manifest exists."""
    if verify:
        verify_manifest(path)
    elif not os.path.isfile(os.path.join(path, MANIFEST)):
        raise CheckpointError(f"checkpoint {path} is incomplete: no {MANIFEST} (the save did not finish)")


def newest_complete(root: str, verify: bool = True) -> Optional[str]:
    """The newest checkpoint under `root` that passes `_verify` (skipping broken ones; said when verifying)."""
    for path in reversed(checkpoint_dirs(root)):
        try:
            _verify(path, verify)
            return path
        except CheckpointError as exc:
            if verify:
                print(f"checkpoint: skipping {path}: {exc}", flush=True)
    return None


def is_checkpoint_root(path: str) -> bool:
    """True if `path` holds `iter_<k>` checkpoints, False if it is one checkpoint directory (it has
    meta.json, manifest.json or DCP files); CheckpointError if it is neither or does not exist.
    Looks at names only (cheap, for the start-up config check); verifies nothing."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} does not exist" if not os.path.exists(path) else f"{path} is not a directory")
    if os.path.isfile(os.path.join(path, META)):
        return False
    if checkpoint_dirs(path):
        return True
    if any(os.path.exists(os.path.join(path, name)) for name in (MANIFEST, DCP_METADATA)):
        return False
    raise CheckpointError(f"{path} is not a checkpoint (no {META} or {MANIFEST}) and holds no iter_<k> checkpoints")


def resolve_checkpoint(path: str, verify: bool = True) -> str:
    """A checkpoint directory, or a checkpoint root (-> its newest complete checkpoint), verified."""
    if not is_checkpoint_root(path):
        _verify(path, verify)
        return path
    found = newest_complete(path, verify)
    if found is None:
        raise CheckpointError(f"{path} holds no complete checkpoint")
    return found


def load_path(cfg: Config, verify: bool = True) -> Optional[str]:
    """The verified checkpoint `checkpoint.load` asks for, or None (start from scratch).
    `auto`: the newest complete one under `checkpoint_dir(cfg)`, None if there is none. `verify=False`:
    by names only (`--check-config`, training/resume.py; the ranks verify the files when they load)."""
    ck = cfg.checkpoint
    if ck.load is None:
        return None
    if ck.load == "auto":
        return newest_complete(checkpoint_dir(cfg), verify)
    return resolve_checkpoint(ck.load, verify)


# -- load ---------------------------------------------------------------------------------------
def read_meta(path: str) -> dict:
    return read_json(os.path.join(path, META))


def checkpoint_config(path: str, overrides=()) -> Config:
    """The resolved config saved in a checkpoint, with dotted `overrides` applied."""
    return load_config(os.path.join(path, CONFIG), list(overrides))


# a checkpoint's config without pipeline stages (single-process models, offline resharding)
NO_PIPELINE = ["parallel.pipeline=1", "parallel.pipeline_schedule=1f1b", "parallel.virtual_stages=1",
               "parallel.pipeline_layers=null"]


def single_process_config(path: str) -> Config:
    """A checkpoint's config for one process (parallel degrees 1, nothing to load at start-up)."""
    return checkpoint_config(path, ["parallel.tensor=1", "parallel.expert=1", "parallel.expert_shard=1",
                                    "checkpoint.load=null"] + NO_PIPELINE)


def check_consumed(path: str, meta: dict, cfg: Config) -> None:
    """A checkpoint with optimizer state resumes only with the global batch size it was trained with
    (the data position and the LR schedule count its iterations)."""
    if meta.get("has_optimizer") and meta["consumed_samples"] != meta["iteration"] * cfg.training.global_batch_size:
        raise CheckpointError(
            f"checkpoint {path} consumed {meta['consumed_samples']} samples in {meta['iteration']} iterations, but "
            f"training.global_batch_size={cfg.training.global_batch_size}: resuming needs the same global batch size")


def load_checkpoint(path: str, cfg: Config, state: ParallelState, model: torch.nn.Module,
                    optimizer: Optional[torch.optim.Optimizer]) -> dict:
    """Collective: load a verified checkpoint into `model` (and `optimizer`), resharding to this
    layout; restore RNG states if the layout is unchanged. Returns its meta.json."""
    meta = read_meta(path)
    if optimizer is not None:
        check_consumed(path, meta, cfg)
    saved = meta.get("balancers")
    if saved and saved["balancer"] == cfg.moe.balancer and saved["layout"] == layout_dict(state):
        _load_balancer_states(model, saved["layers"])  # vExpert slots as saved: entries follow them
        fit_optimizer_rows(list(model.parameters()), optimizer)  # stacks re-shaped: their state too
    adam_states = None
    distributed = isinstance(optimizer, DistributedOptimizer)
    if optimizer is not None and meta.get("has_optimizer"):
        if distributed:
            optimizer.reset_state()  # the entries are views into its zeroed shards
        else:  # fp32 moments (and, bf16 runs, fp32 masters) whatever the parameters' dtype
            adam_states = {name: {"exp_avg": torch.zeros_like(p, dtype=torch.float32),
                                  "exp_avg_sq": torch.zeros_like(p, dtype=torch.float32),
                                  "step": torch.zeros((), dtype=torch.float32)} for name, p in trained_parameters(model)}
            if hasattr(optimizer, "masters_to_params"):
                for name, p in trained_parameters(model):
                    adam_states[name]["master"] = torch.zeros_like(p, dtype=torch.float32)
    masters = master_weights(model, optimizer, adam_states)  # also for weights-only checkpoints
    entries = model_entries(model, state, masters)  # fp32 checkpoints load into bf16 runs' masters
    if optimizer is not None and meta.get("has_optimizer"):
        entries.update(optimizer_entries(model, optimizer, state, adam_states))
    from megatron_moe.training import checkpoint_io  # DCP: imported when first needed (~1 s per process)
    same_layout = meta["layout"] == layout_dict(state)
    rng = {}
    if same_layout:
        prefix = f"rng/rank{state.rank}/"
        for key, md in checkpoint_io.read_metadata(path).state_dict_metadata.items():
            if key.startswith(prefix):
                rng[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
                entries[key] = full_entry(rng[key])
    with torch.no_grad():
        checkpoint_io.load_entries(entries, path)
    if adam_states is not None:
        _set_adam_states(model, optimizer, adam_states)
    elif distributed and meta.get("has_optimizer"):
        optimizer.load_steps()
    if masters:  # bf16 runs: the parameters from the fp32 masters just loaded
        optimizer.masters_to_params()
    _set_rng_states(model, state, rng)
    return meta


def _balancer_states(model: torch.nn.Module, state: ParallelState) -> Dict[str, dict]:
    """Collective over ``pp``: {MoE layer index: its balancer's `state_dict()`} of every pipeline
    stage, for balancers that have state (vExperts)."""
    layers = model.moe_layers() if hasattr(model, "moe_layers") else []
    mine = {str(layer.layer_index): st for layer in layers if (st := layer.balancer.state_dict())}
    if state.pp_size == 1:
        return mine
    return {k: v for stage in collectives.all_gather_object(mine, state.pp) for k, v in stage.items()}


def _load_balancer_states(model: torch.nn.Module, states: Dict[str, dict]) -> None:
    """Restore each layer's balancer state where its vExpert slots have the saved shape (a run
    with another slot count starts from the owners' layout)."""
    for layer in model.moe_layers():
        st = states.get(str(layer.layer_index))
        table = layer.experts.slot_table
        if st is not None and table is not None and list(table.shape) == [len(st["slots"]), len(st["slots"][0])]:
            layer.balancer.load_state_dict(st)


def _set_adam_states(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     adam_states: Dict[str, Dict[str, torch.Tensor]]) -> None:
    """Install per-name AdamW tensors through `load_state_dict` (it casts/moves them like torch does)."""
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    sd = optimizer.state_dict()
    sd["state"] = {index[id(p)]: adam_states[name] for name, p in model.named_parameters() if id(p) in index}
    optimizer.load_state_dict(sd)


@section_check("checkpoint")
def _check_checkpoint(cfg, world_size: int) -> None:
    ck = cfg.checkpoint
    if ck.save_interval < 0 or ck.keep_last < 0:
        raise ConfigError("checkpoint.save_interval and checkpoint.keep_last must be >= 0")
    tr = cfg.training
    if tr.eval_only and ck.load is None:
        raise ConfigError("training.eval_only=true evaluates a checkpoint: set checkpoint.load "
                          "(auto: this run's newest, or a path)")
    if tr.eval_only and (tr.eval_iters < 1 or tr.eval_interval < 1):
        raise ConfigError(f"training.eval_only=true needs training.eval_iters >= 1 and training.eval_interval >= 1 "
                          f"(the valid batches training evaluates; got {tr.eval_iters} and {tr.eval_interval})")
    if ck.load not in (None, "auto"):  # a path: a checkpoint or a root of iter_<k> checkpoints (names only)
        try:
            is_checkpoint_root(ck.load)
        except CheckpointError as exc:
            raise checkpoint_load_error(ck.load, exc) from None


def checkpoint_load_error(load: str, exc: Exception) -> ConfigError:
    """The one-line error for a checkpoint that `checkpoint.load` names but that cannot be resumed."""
    return ConfigError(f"checkpoint.load={load}: {exc}")


def checkpoint_tokenizer_dir(path: str) -> Optional[str]:
    """Checkpoint `path`'s `tokenizer/` directory, None if it carries none (conversions copy it)."""
    directory = os.path.join(path, CHECKPOINT_TOKENIZER)
    return directory if os.path.isdir(directory) else None
