"""Wall-clock timing of distributed work for the measuring tools (`tools/profile_comm.py`,
`benchmarks/moe_layer.py`): every rank starts together, the slowest rank's time counts."""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.parallel_state import ParallelState, RankLayout


def init_state(tensor: int, expert: int, expert_shard: int, backend: str = "auto",
               ranks_per_node: Optional[int] = None) -> ParallelState:
    """Process group from torchrun's environment (or one process) and the ParallelState of a layout
    (nodes as given, else as the launcher placed the ranks)."""
    from megatron_moe.distributed import launch

    info = launch.initialize(backend)
    layout = RankLayout(world_size=info.world_size, tensor=tensor, expert=expert, expert_shard=expert_shard,
                        ranks_per_node=ranks_per_node or info.ranks_per_node)
    return ParallelState.build(layout, info.rank)


def slowest_rank_seconds(fn: Callable[[], object], state: ParallelState) -> float:
    """Barrier, run `fn` on every rank, return the largest elapsed time (identical on all ranks).
    The final max-reduction is not counted in COMM_STATS' snapshot taken inside `fn`."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # NCCL: launch set the device
    C.barrier(state.world)
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64,
                           device=torch.device("cuda", torch.cuda.current_device()) if cuda else "cpu")
    return float(C.all_reduce(elapsed, state.world, op="max"))
