"""Process-group initialization from torchrun's or SLURM's environment (or a single process).

Sources, in this order (torchrun inside a SLURM allocation is torchrun):
- torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
- a SLURM job step (`srun`, one task per rank): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID. Only
  inside a step (SLURM_STEP_ID set): the batch script itself also carries SLURM_PROCID=0 and the
  allocation's SLURM_NTASKS, but it is one process. Master: MASTER_ADDR / MASTER_PORT when set
  (the sbatch scripts export them), else the first host of SLURM_STEP_NODELIST (or
  SLURM_JOB_NODELIST) and port 10000 + job id % 20000, below Linux's ephemeral port range.
- otherwise one process, no process group.

Backend: `auto` is NCCL when CUDA is available and gloo otherwise. With NCCL each rank uses GPU
`local_rank` of the ones it sees, or GPU 0 when it sees only one (`srun --gpus-per-task=1`).

`python -m megatron_moe.distributed.launch master` prints "MASTER_ADDR MASTER_PORT" for the
current SLURM job (used by scripts/slurm/).
"""
from __future__ import annotations

import argparse
import itertools
import os
import re
from dataclasses import dataclass, replace
from typing import List, Mapping, Optional, Tuple

import torch

from megatron_moe.distributed import collectives

BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class LaunchInfo:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun" | "slurm" | "single"
    backend: str = "gloo"  # set by initialize(): "gloo" | "nccl" (a process group exists if world_size > 1)
    device: str = "cpu"  # set by initialize(): "cpu" | "cuda:N"
    ranks_per_node: Optional[int] = None  # the launcher's ranks per node (None: unknown, one node)


def ranks_per_node_from_env(env: Mapping[str, str]) -> Optional[int]:
    """Ranks per node as the launcher placed them: torchrun's LOCAL_WORLD_SIZE, SLURM's
    SLURM_NTASKS_PER_NODE or the first count of SLURM_TASKS_PER_NODE ('4(x2),2' -> 4)."""
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        match = re.match(r"^(\d+)", env.get(key, ""))
        if match:
            return int(match.group(1))
    return None


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _expand_ranges(ranges: str) -> List[str]:
    """'03-05,7' -> ['03', '04', '05', '7'] (zero padding follows each range's lower bound)."""
    out = []
    for part in ranges.split(","):
        m = _RANGE.match(part.strip())
        if not m:
            raise ValueError(f"invalid range '{part}' in SLURM node list")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"invalid range '{part}' in SLURM node list (end before start)")
        out += [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]
    return out


def expand_nodelist(nodelist: str) -> List[str]:
    """Expand a SLURM host list like `scontrol show hostnames` does, without needing Slurm
    (ranks may run in containers without it): 'node[03-05,7],gpu1' -> node03 node04 node05 node7 gpu1;
    'rack[1-2]-n[01-02]' -> rack1-n01 rack1-n02 rack2-n01 rack2-n02."""
    hosts: List[str] = []
    for item in re.split(r",(?![^\[]*\])", nodelist.strip()):  # commas outside brackets
        if not item:
            raise ValueError(f"invalid SLURM node list '{nodelist}' (empty host)")
        pieces = re.split(r"\[([^\]]*)\]", item)  # text, ranges, text, ranges, ..., text
        if "[" in "".join(pieces[::2]) or "]" in "".join(pieces[::2]):
            raise ValueError(f"invalid SLURM node list '{nodelist}' (unbalanced brackets)")
        choices = [[text] if i % 2 == 0 else _expand_ranges(text) for i, text in enumerate(pieces)]
        hosts += ["".join(parts) for parts in itertools.product(*choices)]
    return hosts


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ValueError(f"environment variable {key}={env[key]!r} is not an integer") from None


def slurm_master(env: Mapping[str, str]) -> Tuple[str, int]:
    """(MASTER_ADDR, MASTER_PORT) of a SLURM job: the variables if set, else derived from the job."""
    addr = env.get("MASTER_ADDR")
    if not addr:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise ValueError("SLURM launch without SLURM_JOB_NODELIST: set MASTER_ADDR")
        addr = expand_nodelist(nodelist)[0]
    port = env.get("MASTER_PORT")
    if not port:
        if not env.get("SLURM_JOB_ID"):
            raise ValueError("SLURM launch without SLURM_JOB_ID: set MASTER_PORT")
        return addr, 10000 + _int(env, "SLURM_JOB_ID") % 20000
    return addr, _int(env, "MASTER_PORT")


def detect_launch(env: Optional[Mapping[str, str]] = None) -> LaunchInfo:
    """Rank, world size, local rank and master address from the environment (see module docstring)."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        info = LaunchInfo(_int(env, "RANK"), _int(env, "WORLD_SIZE"),
                          _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
                          env.get("MASTER_ADDR", "127.0.0.1"),
                          _int(env, "MASTER_PORT") if "MASTER_PORT" in env else 29500, "torchrun",
                          ranks_per_node=ranks_per_node_from_env(env))
    elif "SLURM_STEP_ID" in env and "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        addr, port = slurm_master(env)
        info = LaunchInfo(_int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS"),
                          _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0, addr, port, "slurm",
                          ranks_per_node=ranks_per_node_from_env(env))
    else:
        return LaunchInfo(0, 1, 0, "127.0.0.1", 29500, "single")
    if not 0 <= info.rank < info.world_size:
        raise ValueError(f"{info.source} launch: rank {info.rank} is outside world size {info.world_size}")
    return info


def world_size_from_env(env: Optional[Mapping[str, str]] = None) -> int:
    """The world size a launch will have, known before any process group exists (for validation)."""
    return detect_launch(env).world_size


def pick_backend(requested: str, cuda_available: Optional[bool] = None) -> str:
    """`parallel.backend` -> "nccl" | "gloo" ("auto": NCCL when CUDA is available)."""
    if requested not in BACKENDS:
        raise ValueError(f"parallel.backend={requested} is not one of {', '.join(BACKENDS)}")
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if requested == "nccl" and not cuda:
        raise ValueError("parallel.backend=nccl needs CUDA, which is not available: use gloo or auto")
    if requested == "auto":
        return "nccl" if cuda else "gloo"
    return requested


def default_device(backend: str = "auto") -> torch.device:
    """The device this rank computes on for `parallel.backend`: its current GPU with NCCL (set by
    `initialize`), else the CPU."""
    if pick_backend(backend) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def local_device_index(local_rank: int, device_count: int) -> int:
    """GPU of a rank: its local rank among the node's GPUs, or 0 if it sees only one."""
    if device_count == 1:
        return 0
    if not 0 <= local_rank < device_count:
        raise ValueError(f"local rank {local_rank} has no GPU: this node's ranks see {device_count} GPUs "
                         "(start one task per GPU)")
    return local_rank


def initialize(backend: str = "auto", timeout_s: float = 600.0) -> LaunchInfo:
    """Initialize torch.distributed (skipped for a single process) and set the local device."""
    info = detect_launch()
    backend = pick_backend(backend)
    device = "cpu"
    if backend == "nccl":
        index = local_device_index(info.local_rank, torch.cuda.device_count())
        torch.cuda.set_device(index)
        device = f"cuda:{index}"
    if info.world_size > 1 and not collectives.is_initialized():
        os.environ.setdefault("MASTER_ADDR", info.master_addr)
        os.environ.setdefault("MASTER_PORT", str(info.master_port))
        collectives.init_process_group(backend, info.rank, info.world_size, init_method="env://",
                                       timeout_s=timeout_s)
    return replace(info, backend=backend, device=device)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["master"],
                        help="master: print 'MASTER_ADDR MASTER_PORT' for the current SLURM job")
    parser.parse_args(argv)
    addr, port = slurm_master(os.environ)
    print(addr, port)


if __name__ == "__main__":
    main()
