"""`Group`: one process group as a rank sees it (built by `ParallelState`, used by every collective)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional


@dataclass
class Group:
    """One process group as this rank sees it. `handle` is the torch ProcessGroup (None if the
    process group machinery is not initialized, e.g. single process). `side_handle`: a second
    process group over the same ranks (`ParallelState.build(side_channels=...)`), for traffic that
    stays in flight while the group's collectives run and must not queue behind them or they
    behind it (one communicator serializes its work: NCCL on its stream, gloo on its connections);
    None when none was built."""

    name: str
    ranks: List[int]
    rank: int  # index of this process within `ranks`
    handle: Optional[Any] = None
    ranks_per_node: Optional[int] = None  # RankLayout's: which members share this rank's node
    side_handle: Optional[Any] = None

    @property
    def size(self) -> int:
        return len(self.ranks)

    def global_rank(self, index: int) -> int:
        return self.ranks[index]

    def node_of(self, index: int) -> int:
        """The node member `index` runs on (global rank // ranks per node; one node without a value)."""
        return self.ranks[index] // (self.ranks_per_node or max(self.ranks) + 1)

    def off_node(self, index: int) -> bool:
        """Is member `index` on another node than this rank (its traffic crosses the network)?"""
        return self.node_of(index) != self.node_of(self.rank)
