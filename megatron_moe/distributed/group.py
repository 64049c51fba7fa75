"""`Group`: one process group as a rank sees it (built by `ParallelState`, used by every collective)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, List, Optional

import torch


@dataclass
class Group:
    """One process group as this rank sees it. `handle` is the torch ProcessGroup (None if the
    process group machinery is not initialized, e.g. single process). `side_handle`: a second
    process group over the same ranks (`ParallelState.build(side_channels=...)`), for traffic that
    stays in flight while the group's collectives run and must not queue behind them or they
    behind it (one communicator serializes its work: NCCL on its stream, gloo on its connections);
    None when none was built. `device`: where every tensor entering a collective on it must live
    (NCCL: the rank's GPU, gloo: the CPU; `collectives.backend_device`); None for a group without
    a process group (a single rank), where collectives are no-ops."""

    name: str
    ranks: List[int]
    rank: int  # index of this process within `ranks`
    handle: Optional[Any] = None
    ranks_per_node: Optional[int] = None  # RankLayout's: which members share this rank's node
    side_handle: Optional[Any] = None
    device: Optional[torch.device] = None

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

    def side_channel(self) -> "Group":
        """The side channel as a Group of its own, named "<name>_side" (the collectives' counters
        key by group name, so its traffic is told apart from the group's); this group where it has
        none (`side_handle` None: not built, or a single rank)."""
        if self.side_handle is None:
            return self
        return replace(self, name=f"{self.name}_side", handle=self.side_handle, side_handle=None)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """`t` on this group's device (a no-op where it is there or the group has none): every
        tensor built on the host (numpy, Python lists) goes through it before a collective."""
        return t if self.device is None else t.to(self.device)

    def check_device(self, device: torch.device) -> None:
        """Raise unless a tensor on `device` may enter a collective on this group (an NCCL group has
        no CPU backend): every op in `collectives` checks its tensors."""
        if self.device is not None and device != self.device:
            raise RuntimeError(f"collective on group {self.name!r}: a tensor on {device}, but its backend needs "
                               f"{self.device} (put it there with Group.to_device)")
