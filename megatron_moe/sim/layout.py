"""Every simulated rank's coordinates as arrays (`RankLayout`'s arithmetic, vectorized over the world).

    world = WorldLayout(RankLayout(world_size=1024, tensor=4, expert=64, expert_shard=4, ranks_per_node=8))
    world.coord["ep"]          # Int[W] EP rank of every rank
    world.group_id["tp"]       # Int[W] which tp group every rank is in (groups partition the world)
    world.spans_nodes["ep"]    # Bool[W] does the rank's ep group span several nodes?
    world.group_max("ep", x)   # Float[W] the max of x over each rank's ep group

A simulated iteration runs on one pipeline stage (`parallel.pipeline` 1). The expert view's
`ep_esp` groups are indexed by `edp` rank; inside one, ranks are ``ep_rank * esp + esp_rank``.
"""
from __future__ import annotations

from typing import Dict

import numpy as np

from megatron_moe.distributed.parallel_state import GROUP_NAMES, RankLayout


class WorldLayout:
    def __init__(self, layout: RankLayout):
        if layout.pipeline != 1:
            raise ValueError(f"the simulator models one pipeline stage; parallel.pipeline={layout.pipeline}")
        self.layout = layout
        W = layout.world_size
        self.size = W
        rank = np.arange(W)
        tp, ep, esp = layout.tensor, layout.expert, layout.expert_shard
        dp, tp_rank = np.divmod(rank, tp)
        edp, inner = np.divmod(rank, ep * esp)
        ep_rank, esp_rank = np.divmod(inner, esp)
        zero = np.zeros(W, dtype=np.int64)
        self.coord: Dict[str, np.ndarray] = {"tp": tp_rank, "dp": dp, "pp": zero, "ep": ep_rank, "esp": esp_rank,
                                             "ep_esp": inner, "edp": edp, "embedding": zero, "world": rank}
        # a rank's group of each kind is identified by the coordinates it shares with its members
        # (one stage: every rank's pp and embedding groups are itself)
        self.group_id: Dict[str, np.ndarray] = {
            "tp": dp, "dp": tp_rank, "pp": rank, "esp": edp * ep + ep_rank, "ep": edp * esp + esp_rank,
            "ep_esp": edp, "edp": inner, "embedding": rank, "world": zero}
        self.group_size = {"tp": tp, "dp": layout.data_parallel, "pp": 1, "esp": esp, "ep": ep, "ep_esp": ep * esp,
                           "edp": layout.expert_data_parallel, "embedding": 1, "world": W}
        self._members: Dict[str, np.ndarray] = {}
        per_node = layout.ranks_per_node or W
        self.node = rank // per_node
        self.spans_nodes = {name: self.group_max(name, self.node) != self.group_min(name, self.node)
                            for name in GROUP_NAMES}

    def members(self, name: str) -> np.ndarray:
        """Int[G, n]: the global ranks of every `name` group in member order (ascending)."""
        if name not in self._members:
            order = np.lexsort((np.arange(self.size), self.group_id[name]))
            self._members[name] = order.reshape(-1, self.group_size[name])
        return self._members[name]

    def _reduce(self, name: str, values, reduce) -> np.ndarray:
        members = self.members(name)
        if members.shape[1] == 1:
            return np.asarray(values, dtype=np.float64)
        out = np.empty(self.size)
        out[members] = reduce(np.broadcast_to(np.asarray(values, dtype=np.float64), (self.size,))[members],
                              axis=1)[:, None]
        return out

    def group_max(self, name: str, values: np.ndarray) -> np.ndarray:
        """Float[W]: the max of `values` [W] over each rank's `name` group."""
        return self._reduce(name, values, np.max)

    def group_min(self, name: str, values: np.ndarray) -> np.ndarray:
        return self._reduce(name, values, np.min)

    def global_rank(self, edp: int, ep_rank: np.ndarray, esp_rank: np.ndarray) -> np.ndarray:
        """Global ranks of (ep_rank, esp_rank) pairs (broadcast) inside ep_esp group `edp`."""
        lay = self.layout
        return edp * lay.expert * lay.expert_shard + np.asarray(ep_rank) * lay.expert_shard + np.asarray(esp_rank)

    def ep_esp_ranks(self, edp: int) -> np.ndarray:
        """Int[ep * esp]: the global ranks of ep_esp group `edp`, in group order."""
        n = self.layout.expert * self.layout.expert_shard
        return np.arange(edp * n, (edp + 1) * n)
