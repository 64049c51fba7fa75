"""Shared `main()` of the pretraining entry points (pretrain_gpt_moe.py, pretrain_bert_moe.py).

    --config FILE section.key=value ...  ->  load_config -> validate_config + validate_data_config
    (+ `parallel.ranks_per_node` against SLURM's placement; before any process group)
    -> launch.initialize (+ every rank's host) -> validate_placement -> ParallelState
    -> Trainer(cfg, state, model_cls, datasets).train()

    --check-config [--world-size N] --config FILE ...  ->  the same checks for N processes, and
    the checkpoint that `checkpoint.load` would resume against the config (training/resume.py: its
    config.yaml and meta.json, no tensor), then exit (0 = ok; no process group, no model). The
    launchers in scripts/ run it once before starting the ranks, so a bad config is reported once
    and no launcher adds its own failure report.

A bad config prints one line `config error: ...` to stderr (rank 0) and exits with code 2, no
traceback; so does a checkpoint that `checkpoint.load` names but that cannot be resumed (missing,
not a checkpoint, corrupt, another model or global batch size): `config error: checkpoint.load=PATH:
<reason>`. A non-finite loss or gradient with `training.on_nonfinite: stop` prints one line
`stopped: ...` (rank 0) and exits with code 3 on every rank (`training/failures.py`). A host that
cannot join a multi-node launch (gloo would listen on a loopback address) prints one line
`launch error: ...` on each of its ranks and exits with code 2. Ctrl-C (SIGINT) once the training
loop runs stops as SIGTERM does (training/failures.py: finish the iteration, save, exit 0); before
it, or a second one, ends the process with one line and exit code 130.
"""
from __future__ import annotations

import os
import sys
from typing import Callable, List, Optional

from megatron_moe.config import Config, ConfigError, load_config, parse_cli, validate_config
from megatron_moe.config.registry import Registry
from megatron_moe.config.validate import validate_placement
from megatron_moe.data.datasets import validate_data_config
from megatron_moe.distributed import collectives, launch
from megatron_moe.distributed.parallel_state import ParallelState, RankLayout, side_channels
from megatron_moe.perf.host_memory import keep_freed_host_memory
from megatron_moe.training.checkpoint import checkpoint_load_error
from megatron_moe.training.failures import (CONFIG_ERROR_EXIT, INTERRUPT_EXIT, NONFINITE_EXIT, CheckpointError,
                                            NonFiniteError)
from megatron_moe.training.resume import preview_resume
from megatron_moe.training.trainer import Trainer

__all__ = ["CONFIG_ERROR_EXIT", "main", "train"]


# "hf": (cfg, family, model_cls) -> the family export-hf writes, else ConfigError (convert/export_check.py)
EXPORT_CHECKS: Registry = Registry("--export-family")


def main(model_cls: type, argv: Optional[List[str]] = None, description: str = "",
         datasets: Optional[Callable] = None) -> int:
    """`datasets(cfg) -> (train, valid)` builds the model's samples (None: GPT's)."""
    args = parse_cli(argv, description)
    info = launch.detect_launch()
    try:
        cfg = load_config(args.config, args.overrides)
        world_size = args.world_size or info.world_size
        validate_config(cfg, world_size)
        validate_placement(cfg, launch.placement_from_env(os.environ, world_size))  # SLURM: the job's nodes
        validate_data_config(cfg, note=print if info.rank == 0 else None)
        if args.export_family:  # with --check-config: ConfigError naming why export-hf would refuse it
            family = EXPORT_CHECKS.get("hf")(cfg, args.export_family, model_cls)
            print(f"export ok: export-hf --family {family} accepts it")
        try:
            if args.check_config:
                resumes = preview_resume(cfg)  # the checkpoint it would resume, by its metadata
                print("\n".join([f"config ok: {args.config} on {world_size} process{'es' if world_size > 1 else ''}"]
                                + resumes))
                return 0
            train(cfg, model_cls, datasets)
        except CheckpointError as exc:  # resuming from what checkpoint.load names failed
            raise checkpoint_load_error(cfg.checkpoint.load, exc) from None
    except ConfigError as exc:
        if info.rank == 0:
            print(f"config error: {exc}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    except launch.LaunchError as exc:  # this host cannot join the launch: every rank that finds it says so
        print(f"launch error: {exc}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    except NonFiniteError as exc:
        if info.rank == 0:
            print(f"stopped: {exc}", file=sys.stderr)
        return NONFINITE_EXIT
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (start-up, the last teardown)
        if info.rank == 0:
            print("interrupted (SIGINT) outside the training loop: nothing saved", file=sys.stderr)
        return INTERRUPT_EXIT
    return 0


def train(cfg: Config, model_cls: type, datasets: Optional[Callable] = None) -> None:
    """Create the process groups for a validated `cfg` and train."""
    par = cfg.parallel
    keep_freed_host_memory()  # CPU steps reuse freed activations instead of faulting pages in (perf/host_memory.py)
    info = launch.initialize(par.backend, par.timeout_s)
    state = None
    try:
        ranks_per_node = validate_placement(cfg, info.placement)  # the same on every rank
        if info.rank == 0 and len(info.placement.nodes()) > 1:
            print(f"placement: {info.placement.describe()}", flush=True)
        layout = RankLayout(world_size=info.world_size, tensor=par.tensor, pipeline=par.pipeline,
                            expert=par.expert, expert_shard=par.expert_shard, ranks_per_node=ranks_per_node)
        state = ParallelState.build(layout, info.rank, side_channels(cfg))
        Trainer(cfg, state, model_cls, datasets).train()
        collectives.barrier(state.world)  # no rank tears its connections down while another still uses them
    finally:
        collectives.destroy_process_group(state)
