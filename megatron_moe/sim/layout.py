"""The ranks of one pipeline stage and their coordinates as arrays (`RankLayout`'s arithmetic,
vectorized over the stage).

    world = WorldLayout(RankLayout(world_size=1024, tensor=4, expert=64, expert_shard=4, ranks_per_node=8))
    world.coord["ep"]          # Int[S] EP rank of every rank of the stage (S = world / pipeline)
    world.group_id["tp"]       # Int[S] which tp group every rank is in (groups partition the stage)
    world.spans_nodes["ep"]    # Bool[S] does the rank's ep group span several nodes?
    world.group_max("ep", x)   # Float[S] the max of x over each rank's ep group

Pipeline stage `stage` holds global ranks `offset + local` (offset = stage x S), which fixes the
nodes. The groups inside the stage (`STAGE_GROUPS`) have members, group max / min; inside a stage
the expert view's `ep_esp` groups are indexed by `edp` rank; inside one, ranks are
``ep_rank * esp + esp_rank``. The groups across stages (`pp`, `embedding`, `world`) have every
rank's coordinate, group id (ranks of this stage in one group share it), size and whether the
group spans nodes, as ParallelState's; their collectives are timed across the stages by
`sim/stages.py`. With one stage, every rank's `pp` and `embedding` groups are itself. `ep_node`
(an ep group's members on one node) has coordinates, group ids, node spans (none) and a size per
rank, Int[S] (a node boundary may cut ep groups unevenly); no op is simulated on it (its one user,
`moe.token_dispatch: node_dedup`, is refused by sim/runner.py), so it is no `STAGE_GROUPS` member.
"""
from __future__ import annotations

from typing import Dict

import numpy as np

from megatron_moe.distributed.parallel_state import RankLayout

STAGE_GROUPS = ("tp", "dp", "ep", "esp", "ep_esp", "edp")


class WorldLayout:
    def __init__(self, layout: RankLayout, stage: int = 0):
        self.layout, self.stage = layout, stage
        S = layout.stage_size
        self.size, self.offset = S, stage * S
        rank = np.arange(S)
        tp, ep, esp = layout.tensor, layout.expert, layout.expert_shard
        dp, tp_rank = np.divmod(rank, tp)
        edp, inner = np.divmod(rank, ep * esp)
        ep_rank, esp_rank = np.divmod(inner, esp)
        self.coord: Dict[str, np.ndarray] = {"tp": tp_rank, "dp": dp, "ep": ep_rank, "esp": esp_rank, "ep_esp": inner,
                                             "edp": edp}
        # a rank's group of each kind is identified by the coordinates it shares with its members
        self.group_id: Dict[str, np.ndarray] = {"tp": dp, "dp": tp_rank, "esp": edp * ep + ep_rank,
                                                "ep": edp * esp + esp_rank, "ep_esp": edp, "edp": inner}
        self.group_size = {"tp": tp, "dp": layout.data_parallel, "esp": esp, "ep": ep, "ep_esp": ep * esp,
                           "edp": layout.expert_data_parallel}
        self._members: Dict[str, np.ndarray] = {}
        self.node = layout.node_of(self.offset + rank)
        self.spans_nodes = {name: self.group_max(name, self.node) != self.group_min(name, self.node)
                            for name in STAGE_GROUPS}
        # ep_node: ep's members on the rank's node below it (RankLayout.coords); a group's id, its first member
        self.coord["ep_node"] = np.minimum(ep_rank, (self.offset + rank) % layout.node_size // esp)
        self.group_id["ep_node"] = first = rank - self.coord["ep_node"] * esp
        self.group_size["ep_node"] = np.bincount(first, minlength=S)[first]
        self.spans_nodes["ep_node"] = np.zeros(S, dtype=bool)
        # the groups across stages, as ParallelState has them: a rank's pp group is its local rank on
        # every stage, its embedding group the first and last stage's (a middle stage's rank alone)
        p, zero = layout.pipeline, np.zeros(S, dtype=np.int64)
        ends = p > 1 and stage in (0, p - 1)
        self.coord.update(pp=zero + stage, embedding=zero + int(p > 1 and stage == p - 1), world=self.offset + rank)
        self.group_id.update(pp=rank, embedding=rank if ends else self.offset + rank, world=zero)
        self.group_size.update(pp=p, embedding=2 if ends else 1, world=layout.world_size)
        for name, stages in (("pp", range(p)), ("embedding", (0, p - 1) if ends else (stage,))):
            nodes = np.stack([layout.node_of(t * S + rank) for t in stages])  # [member stages, S]
            self.spans_nodes[name] = (nodes != nodes[0]).any(0)
        self.spans_nodes["world"] = np.full(S, layout.node_of(layout.world_size - 1) > 0)

    def members(self, name: str) -> np.ndarray:
        """Int[G, n]: the stage's ranks of every `name` group in member order (ascending); only the
        groups inside the stage (`STAGE_GROUPS`)."""
        assert name in STAGE_GROUPS, f"group {name}: across pipeline stages (sim/stages.py) or of uneven sizes"
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
        """Float[S]: the max of `values` [S] over each rank's `name` group."""
        return self._reduce(name, values, np.max)

    def group_min(self, name: str, values: np.ndarray) -> np.ndarray:
        return self._reduce(name, values, np.min)

    def ep_esp_ranks(self, edp: int) -> np.ndarray:
        """Int[ep * esp]: the stage's ranks of ep_esp group `edp`, in group order."""
        n = self.layout.expert * self.layout.expert_shard
        return np.arange(edp * n, (edp + 1) * n)
