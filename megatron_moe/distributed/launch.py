"""Process-group initialization from torchrun's or SLURM's environment (or a single process).

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT. Under `srun` (one task per
rank) SLURM sets SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and SLURM_JOB_NODELIST; the master is
the first host of the node list (MASTER_PORT defaults to a port derived from the job id).
Backend: `parallel.backend=auto` picks NCCL when CUDA is available, gloo otherwise.
"""
from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_moe.distributed import collectives


@dataclass
class LaunchInfo:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun" | "slurm" | "single"


def first_host(nodelist: str) -> str:
    """First hostname of a SLURM node list ('node[03-05,7],gpu1' -> 'node03'), without scontrol."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.split()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    head = re.split(r",(?![^\[]*\])", nodelist)[0]
    m = re.match(r"^(.*?)\[([^\]]+)\](.*)$", head)
    if not m:
        return head
    prefix, ranges, suffix = m.groups()
    first = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{first}{suffix}"


def detect_launch(env: Optional[dict] = None) -> LaunchInfo:
    env = dict(os.environ if env is None else env)
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchInfo(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                          env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500)), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        port = int(env.get("MASTER_PORT", 20000 + int(env.get("SLURM_JOB_ID", 0)) % 20000))
        addr = env.get("MASTER_ADDR") or first_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        return LaunchInfo(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)),
                          addr, port, "slurm")
    return LaunchInfo(0, 1, 0, "127.0.0.1", 29500, "single")


def world_size_from_env(env: Optional[dict] = None) -> int:
    """The world size a launch will have, known before any process group exists (for validation)."""
    return detect_launch(env).world_size


def pick_backend(requested: str) -> str:
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def initialize(backend: str = "auto", timeout_s: float = 600.0) -> LaunchInfo:
    """Initialize torch.distributed (skipped for a single process) and set the local device."""
    info = detect_launch()
    backend = pick_backend(backend)
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank)
    if info.world_size > 1 and not collectives.is_initialized():
        os.environ.setdefault("MASTER_ADDR", info.master_addr)
        os.environ.setdefault("MASTER_PORT", str(info.master_port))
        collectives.init_process_group(backend, info.rank, info.world_size, init_method="env://",
                                       timeout_s=timeout_s)
    return info
