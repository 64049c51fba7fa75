"""The `launch` block of a sweep file: backend and resources of each run (docs/sweeps.md).

World size = `nproc` = `nodes` x `tasks_per_node` (one process per rank, as the launchers in
scripts/ start them). Locally `nproc` processes under torchrun on this machine; on SLURM `nodes`
nodes of `tasks_per_node` tasks each, give either or both. The resource keys (`SHAPE_KEYS`) may
vary per run (`launch.nproc: [2, 4]` in the grid); runs with the same resources share one job array.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from megatron_moe.config import ConfigError

BACKENDS = ("local", "slurm")
SHAPE_KEYS = ("nproc", "nodes", "tasks_per_node", "gpus_per_node", "cpus_per_task", "partition", "account", "time")


@dataclass(frozen=True)
class Launch:
    backend: str
    nodes: int
    tasks_per_node: int
    gpus_per_node: Optional[int] = None
    cpus_per_task: Optional[int] = None
    partition: Optional[str] = None
    account: Optional[str] = None
    time_min: Optional[int] = None  # SLURM time limit of each run's job, minutes
    max_parallel: int = 1  # runs at once (local processes, or the array's %N throttle)
    signal_delay_s: int = 180  # SLURM sends SIGUSR1 this long before the time limit (--signal=USR1@N)
    sbatch: Tuple[Tuple[str, Any], ...] = ()  # further sbatch options {option: value}

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node

    @property
    def shape(self) -> tuple:
        """What one SLURM job array must share."""
        return (self.nodes, self.tasks_per_node, self.gpus_per_node, self.cpus_per_task, self.partition,
                self.account, self.time_min)

    def describe(self) -> str:
        if self.backend == "local":
            return f"{self.world_size} process{'es' if self.world_size > 1 else ''}"
        gpus = f", {self.gpus_per_node} GPUs per node" if self.gpus_per_node else ""
        return f"{self.nodes} node{'s' if self.nodes > 1 else ''} x {self.tasks_per_node} tasks{gpus}"


def parse_time(value: Any, where: str) -> int:
    """SLURM's time formats (minutes, M:S, H:M:S, D-H, D-H:M, D-H:M:S) -> whole minutes, rounded up."""
    m = None if isinstance(value, bool) else re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", str(value).strip())
    if m is None:
        raise ConfigError(f"{where}.time={value!r} is not a SLURM time (minutes, H:M:S or D-H:M:S)")
    days, *rest = m.groups()
    numbers = [int(x) for x in rest if x is not None]
    units = (3600, 60, 1) if days is not None else {1: (60,), 2: (60, 1), 3: (3600, 60, 1)}[len(numbers)]
    seconds = int(days or 0) * 86400 + sum(n * u for n, u in zip(numbers, units))
    if seconds <= 0:
        raise ConfigError(f"{where}.time={value!r} must be positive")
    return math.ceil(seconds / 60)


def _positive(raw: Dict[str, Any], key: str, where: str) -> Optional[int]:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{where}.{key}={value!r} must be a positive integer")
    return value


def make_launch(raw: Dict[str, Any], where: str = "launch") -> Launch:
    """Check a launch mapping and resolve its world size (one-line `ConfigError` naming the key)."""
    backend = raw.get("backend", "local")
    if backend not in BACKENDS:
        raise ConfigError(f"{where}.backend={backend!r} is not one of {' | '.join(BACKENDS)}")
    nproc, nodes, per_node = (_positive(raw, k, where) for k in ("nproc", "nodes", "tasks_per_node"))
    nodes = nodes or 1
    if backend == "local" and nodes > 1:
        raise ConfigError(f"{where}.nodes={nodes}: backend local runs on this machine (use backend: slurm)")
    if per_node is None:
        per_node = (nproc or nodes) // nodes
        if nproc is not None and nproc % nodes:
            raise ConfigError(f"{where}.nproc={nproc} is not a multiple of {where}.nodes={nodes}")
    elif nproc is not None and nproc != nodes * per_node:
        raise ConfigError(f"{where}.nproc={nproc} != nodes x tasks_per_node = {nodes} x {per_node}")
    time_min = None if raw.get("time") is None else parse_time(raw["time"], where)
    if backend == "slurm" and time_min is None:
        raise ConfigError(f"{where}.time is required with backend slurm (each run's time limit: minutes or "
                          "[D-]H:M:S)")
    sbatch = raw.get("sbatch") or {}
    if not isinstance(sbatch, dict):
        raise ConfigError(f"{where}.sbatch must be a mapping {{sbatch option: value}}, got {sbatch!r}")
    delay = raw.get("signal_delay_s", 180)
    if not isinstance(delay, int) or isinstance(delay, bool) or delay < 0:
        raise ConfigError(f"{where}.signal_delay_s={delay!r} must be an integer >= 0")
    for key in ("partition", "account"):
        if raw.get(key) is not None and not isinstance(raw[key], str):
            raise ConfigError(f"{where}.{key}={raw[key]!r} must be a string")
    return Launch(backend=backend, nodes=nodes, tasks_per_node=per_node,
                  gpus_per_node=_positive(raw, "gpus_per_node", where),
                  cpus_per_task=_positive(raw, "cpus_per_task", where), partition=raw.get("partition"),
                  account=raw.get("account"), time_min=time_min,
                  max_parallel=_positive(raw, "max_parallel", where) or 1, signal_delay_s=delay,
                  sbatch=tuple(sorted(sbatch.items())))
