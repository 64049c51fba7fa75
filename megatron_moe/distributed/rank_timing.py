"""Timing on every rank of a layout, for the measuring tools (`tools/profile_comm.py`,
`benchmarks/`, start-up calibration): the process group and `ParallelState` from the launcher, the
slowest rank's wall time of an op (`perf/timing.py` clocks, collectives from `distributed/`)."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from megatron_moe.distributed import collectives as C
from megatron_moe.distributed import launch
from megatron_moe.distributed.parallel_state import ParallelState, RankLayout
from megatron_moe.perf.timing import measure


def init_state(tensor: int, expert: int, expert_shard: int, backend: str = "auto",
               ranks_per_node: Optional[int] = None, side_channels: Sequence[str] = ()) -> ParallelState:
    """Process group from torchrun's environment (or one process) and the ParallelState of a layout
    (nodes as given, else as the launcher placed the ranks; `side_channels` as `ParallelState.build`),
    for the measuring tools (`tools/profile_comm.py`, `benchmarks/moe_layer.py`)."""
    info = launch.initialize(backend)
    layout = RankLayout(world_size=info.world_size, tensor=tensor, expert=expert, expert_shard=expert_shard,
                        ranks_per_node=ranks_per_node or info.ranks_per_node)
    return ParallelState.build(layout, info.rank, side_channels)


def process_device():
    """The device this process's work runs on: the current GPU once NCCL's launch set it, else the CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def slowest_rank_seconds(fn: Callable[[], object], state: ParallelState, device=None) -> float:
    """Barrier, run `fn` on every rank, return the largest wall time (identical on all ranks;
    measurement mode on `device`, default this process's). The final max-reduction is not counted
    in COMM_STATS' snapshot taken inside `fn`."""
    device = device if device is not None else process_device()
    C.barrier(state.world)
    seconds = measure(fn, device)
    elapsed = torch.tensor([seconds], dtype=torch.float64, device=device)
    return float(C.all_reduce(elapsed, state.world, op="max"))
