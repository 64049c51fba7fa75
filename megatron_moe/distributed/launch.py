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

Interfaces: with gloo on several SLURM nodes and no GLOO_SOCKET_IFNAME, `initialize` refuses (one line,
`LaunchError`) a host whose name resolves to a loopback address, where gloo would listen
unreachably (the first collective would fail or hang). NCCL picks its interface itself
(NCCL_SOCKET_IFNAME steers it).

Placement: once the process group exists, `initialize` gathers every rank's hostname and the
address (and interface) it reaches the master from (`Placement`): the real nodes, which
`parallel.ranks_per_node` must match (config/validate.py: `validate_placement`). Before that,
`placement_from_env` reads the placement SLURM will give a job's ranks from the job's node list
and tasks per node (for the config check in the batch script, before srun).

`python -m megatron_moe.distributed.launch master` prints "MASTER_ADDR MASTER_PORT" for the
current SLURM job (used by scripts/slurm/).
"""
from __future__ import annotations

import argparse
import fcntl
import itertools
import os
import re
import socket
import struct
from dataclasses import dataclass, replace
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

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
    # set by initialize(): ranks per node where the ranks fill several hosts in equal blocks (else None)
    ranks_per_node: Optional[int] = None
    placement: Optional["Placement"] = None  # set by initialize(): where every rank runs


@dataclass(frozen=True)
class Placement:
    """Where the ranks run: `hosts[r]` is rank r's hostname, `addrs[r]` the address (and interface)
    it reaches the master from ('' where unknown)."""

    hosts: Tuple[str, ...]
    addrs: Tuple[str, ...] = ()

    def nodes(self) -> List[Tuple[str, List[int]]]:
        """[(host, its ranks)] in the order of each host's first rank."""
        ranks: Dict[str, List[int]] = {}
        for r, host in enumerate(self.hosts):
            ranks.setdefault(host, []).append(r)
        return list(ranks.items())

    def block_size(self) -> Optional[int]:
        """M if node i holds exactly ranks i*M .. (i+1)*M - 1 (what `ranks_per_node` describes), else None."""
        nodes = self.nodes()
        size = len(nodes[0][1])
        ok = all(ranks == list(range(i * size, (i + 1) * size)) for i, (_, ranks) in enumerate(nodes))
        return size if ok else None

    def describe(self) -> str:
        """'2 nodes: n1 10.0.0.1 (eth0) ranks 0-1; n2 10.0.0.2 (eth0) ranks 2-3'."""
        parts = []
        for host, ranks in self.nodes():
            addrs = sorted({self.addrs[r] for r in ranks if r < len(self.addrs) and self.addrs[r]})
            parts.append(" ".join([host] + addrs + [f"rank{'s' if len(ranks) > 1 else ''} {_rank_ranges(ranks)}"]))
        count = len(parts)
        return f"{count} node{'s' if count > 1 else ''}: " + "; ".join(parts)


def _rank_ranges(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, start = [], ranks[0]
    for prev, r in zip(ranks, list(ranks[1:]) + [None]):
        if r != prev + 1:
            out.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = r
    return ",".join(out)


_SIOCGIFADDR = 0x8915


def _interface_of(addr: str) -> str:
    """Name of the local interface holding IPv4 address `addr` ('' if none or not Linux)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == addr:
                return name
    return ""


def route_address(master_addr: str, master_port: int) -> str:
    """'ADDR (IFACE)': the local address (and interface) this host reaches the master from, the one
    the kernel routes to it (no packet is sent); '' if the master cannot be resolved."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master_addr, master_port))
            addr = s.getsockname()[0]
    except OSError:
        return ""
    try:
        iface = _interface_of(addr)
    except OSError:
        iface = ""
    return f"{addr} ({iface})" if iface else addr


def tasks_per_node_from_env(env: Mapping[str, str]) -> Optional[List[int]]:
    """[tasks of node i] from SLURM's '2(x3),1' lists (SLURM_STEP_TASKS_PER_NODE, else
    SLURM_TASKS_PER_NODE) -> [2, 2, 2, 1]; None if unset or malformed."""
    value = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not value:
        return None
    counts: List[int] = []
    for item in value.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not m:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def placement_from_env(env: Mapping[str, str], world_size: int) -> Optional[Placement]:
    """The placement SLURM gives `world_size` ranks of this job (srun's default block distribution:
    node i takes the next tasks-per-node[i] ranks), or None where it cannot be known from the
    environment (not SLURM, another distribution, counts that do not add up to `world_size`)."""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    counts = tasks_per_node_from_env(env)
    if not nodelist or counts is None or env.get("SLURM_DISTRIBUTION", "block").split(":")[0] != "block":
        return None
    try:
        hosts = expand_nodelist(nodelist)
    except ValueError:
        return None
    if len(hosts) != len(counts) or sum(counts) != world_size:
        return None
    return Placement(tuple(host for host, n in zip(hosts, counts) for _ in range(n)))


def gather_placement(info: LaunchInfo) -> Placement:
    """Collective over all ranks (after the process group exists): every rank's hostname and address."""
    from megatron_moe.distributed.parallel_state import Group

    mine = (socket.gethostname(), route_address(info.master_addr, info.master_port))
    if info.world_size == 1 or not collectives.is_initialized():
        return Placement((mine[0],), (mine[1],))
    world = Group("world", list(range(info.world_size)), info.rank)
    gathered = collectives.all_gather_object(mine, world, kind="placement")
    return Placement(tuple(h for h, _ in gathered), tuple(a for _, a in gathered))


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
                          _int(env, "MASTER_PORT") if "MASTER_PORT" in env else 29500, "torchrun")
    elif "SLURM_STEP_ID" in env and "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        addr, port = slurm_master(env)
        info = LaunchInfo(_int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS"),
                          _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0, addr, port, "slurm")
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


class LaunchError(ValueError):
    """This host cannot take part in the launch as configured (one line, printed by each rank)."""


def spans_nodes(env: Mapping[str, str]) -> bool:
    """Does a SLURM job step put its ranks on more than one node? (torchrun's nodes may be one
    machine, so it is not asked.)"""
    if "RANK" in env and "WORLD_SIZE" in env:
        return False
    nodes = env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_JOB_NUM_NODES") or "1"
    return nodes.isdigit() and int(nodes) > 1


def gloo_address_problem(env: Mapping[str, str], hostname: str, resolve=socket.gethostbyname) -> Optional[str]:
    """Why gloo on this host could not be reached from other nodes, or None. Without
    GLOO_SOCKET_IFNAME gloo listens on the address the host's name resolves to, or on the loopback
    address if it does not resolve; a loopback address (e.g. Debian's `127.0.1.1 <hostname>` in
    /etc/hosts) is unreachable from other nodes and the first collective fails or hangs."""
    if env.get("GLOO_SOCKET_IFNAME"):
        return None
    try:
        addr = resolve(hostname)
    except OSError:
        addr = None
    if addr is not None and not addr.startswith("127."):
        return None
    how = f"resolves to {addr}" if addr else "does not resolve"
    return (f"gloo would listen on a loopback address on {hostname} (its name {how}), which the other nodes cannot "
            f"reach: set GLOO_SOCKET_IFNAME to the interface toward the other nodes, or map {hostname} to that "
            f"interface's address (DNS, /etc/hosts)")


def initialize(backend: str = "auto", timeout_s: float = 600.0) -> LaunchInfo:
    """Initialize torch.distributed (skipped for a single process) and set the local device.
    Raises LaunchError if gloo would listen on a loopback address while the ranks span nodes."""
    info = detect_launch()
    backend = pick_backend(backend)
    if backend == "gloo" and info.world_size > 1 and spans_nodes(os.environ):
        problem = gloo_address_problem(os.environ, socket.gethostname())
        if problem:
            raise LaunchError(problem)
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
    placement = gather_placement(info)
    per_node = placement.block_size() if len(placement.nodes()) > 1 else None
    return replace(info, backend=backend, device=device, placement=placement, ranks_per_node=per_node)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["master"],
                        help="master: print 'MASTER_ADDR MASTER_PORT' for the current SLURM job")
    parser.parse_args(argv)
    addr, port = slurm_master(os.environ)
    print(addr, port)


if __name__ == "__main__":
    main()
