"""ParallelState: every process group and this rank's coordinates, built once, passed explicitly.

No module-level globals (DESIGN.md §3). Two views of the same ranks, per pipeline stage:

* dense view   ``dp x tp``          (tp fastest: tensor-parallel ranks are adjacent, inside a node)
* expert view  ``edp x ep x esp``   (esp fastest)

    rank = pp_rank * stage_size + local
    local = dp_rank * tp + tp_rank                       (dense view)
          = edp_rank * (ep * esp) + ep_rank * esp + esp_rank   (expert view)

Groups: ``tp`` (same stage & dp rank), ``dp`` (same stage & tp rank), ``pp`` (same local rank),
``esp`` (same stage, edp, ep), ``ep`` (same stage, edp, esp), ``ep_node`` (the members of one ``ep``
group on one node: nodes are blocks of ``ranks_per_node`` consecutive global ranks, all on one
without it; traffic that never leaves a node, e.g. node_dedup's hop 2, runs on it), ``ep_esp``
(same stage & edp: one full copy of every expert), ``edp`` (same stage, ep, esp: the replicas of
one expert shard),
``embedding`` (the first and the last stage's rank of one local rank: Megatron's embedding group,
which sums the tied word embedding's gradient; a rank of a middle stage is alone in its own),
``world``.

Worked example: world=8, tensor=2, expert=2, expert_shard=2 (pipeline=1, so dp=4, edp=2)::

    rank        0  1  2  3  4  5  6  7
    tp_rank     0  1  0  1  0  1  0  1      tp groups  {0,1} {2,3} {4,5} {6,7}
    dp_rank     0  0  1  1  2  2  3  3      dp groups  {0,2,4,6} {1,3,5,7}
    esp_rank    0  1  0  1  0  1  0  1      esp groups {0,1} {2,3} {4,5} {6,7}   (= tp: DeepSpeed-TED case)
    ep_rank     0  0  1  1  0  0  1  1      ep groups  {0,2} {1,3} {4,6} {5,7}
    edp_rank    0  0  0  0  1  1  1  1      ep_esp     {0,1,2,3} {4,5,6,7};  edp {0,4} {1,5} {2,6} {3,7}

With expert=2 expert_shard=4 tensor=2 the esp group {0,1,2,3} spans two tp groups; with tensor=4
expert=2 expert_shard=2 each esp group {0,1}, {2,3} lies inside the tp group {0,1,2,3}.
On nodes of 4 ranks (``ranks_per_node=4``) the example's ep groups lie inside a node each, so
``ep_node`` = ``ep``; on nodes of 2 every ep group is cut in two: ep_node {0} {2} {1} {3} {4} ...,
each rank alone. With expert=4 on 8 ranks and nodes of 2: ep {0,1,2,3} {4,5,6,7}, ep_node {0,1}
{2,3} {4,5} {6,7}. A rank's ``ep_node`` coordinate is its index among its ep group's members on
its node (those are consecutive ep ranks: nodes are blocks of ranks); groups may differ in size
when a node boundary cuts an ep group unevenly.
Pipeline stages only prepend ``pp_rank * stage_size``: with pipeline=2 on 16 ranks, rank 9 is
local rank 1 of stage 1, its ``pp`` group {1, 9}, its ``embedding`` group {1, 9}.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch

from megatron_moe.config.registry import Hooks
from megatron_moe.distributed import collectives
from megatron_moe.distributed.group import Group

GROUP_NAMES = ("tp", "dp", "pp", "ep", "ep_node", "esp", "ep_esp", "edp", "embedding", "world")
# cfg -> group names that need a side channel (`Group.side_handle`): FlexMoE's best-effort moves,
# FasterMoE's and Pro-Prophet's Trans / Agg (moe/replicas.py), the gradient buckets reduced during
# backward (`optimizer.overlap_grad_reduce`, training/grads.py)
SIDE_CHANNELS: Hooks = Hooks("process-group side channels", ("flexmoe", "fastermoe", "proprophet", "grad_reduce"))
WARM_UP = "warm_up"  # byte-counter kind of `warm_up_p2p`


def warm_up_p2p(group: Group, side: bool = False) -> None:
    """Collective over `group`: one batched ring exchange (an element to the next rank, one from
    the previous) on its communicator (`side`: its side channel; nothing without one), so that later
    batched point-to-point rounds may involve only some ranks: NCCL requires the first
    `batch_isend_irecv` on a communicator to include every rank (torch.distributed.batch_isend_irecv).
    Counted as kind `WARM_UP`."""
    if group.size > 1 and (group.side_handle is not None or not side):
        one = group.to_device(torch.zeros(1))
        ring = ([((group.rank + 1) % group.size, one)], [((group.rank - 1) % group.size, torch.empty_like(one))])
        collectives.p2p_exchange(*ring, group, kind=WARM_UP, side=side).wait()


def side_channels(cfg) -> List[str]:
    """The groups a config's techniques want a side channel on (`SIDE_CHANNELS`), sorted."""
    return sorted({name for _, wants in SIDE_CHANNELS.items() for name in wants(cfg)})


@dataclass(frozen=True)
class RankLayout:
    """Pure rank arithmetic for (world, tp, pp, ep, esp); no process groups. Unit-testable."""

    world_size: int
    tensor: int = 1
    pipeline: int = 1
    expert: int = 1
    expert_shard: int = 1
    ranks_per_node: Optional[int] = None  # consecutive ranks per node (None: all on one node)

    def __post_init__(self):
        assert self.world_size % (self.tensor * self.pipeline) == 0, "validate the config first"
        assert self.stage_size % (self.expert * self.expert_shard) == 0, "validate the config first"

    @property
    def node_size(self) -> int:
        """Consecutive global ranks per node (the world when `ranks_per_node` is None)."""
        return self.ranks_per_node or self.world_size

    def node_of(self, rank):
        """The node global rank `rank` (an int, or an integer array of ranks: one node each) runs on
        (ranks fill nodes in order, as launchers place them)."""
        return rank // self.node_size

    @property
    def stage_size(self) -> int:
        return self.world_size // self.pipeline

    @property
    def data_parallel(self) -> int:
        return self.stage_size // self.tensor

    @property
    def expert_data_parallel(self) -> int:
        return self.stage_size // (self.expert * self.expert_shard)

    def coords(self, rank: int) -> Dict[str, int]:
        """This rank's index inside each group (tp_rank, dp_rank, ...), keyed by group name."""
        pp, local = divmod(rank, self.stage_size)
        dp, tp = divmod(local, self.tensor)
        ep_esp = self.expert * self.expert_shard
        edp, inner = divmod(local, ep_esp)
        ep, esp = divmod(inner, self.expert_shard)
        # ep_node: how many members of the ep group (every esp-th rank) are on this node below this
        # rank: the ep below it, or those in [node start, rank) where the node starts inside the group
        ep_node = min(ep, rank % self.node_size // self.expert_shard)
        last = self.pipeline > 1 and pp == self.pipeline - 1
        return {"tp": tp, "dp": dp, "pp": pp, "ep": ep, "ep_node": ep_node, "esp": esp, "ep_esp": inner,
                "edp": edp, "embedding": int(last), "world": rank}

    def groups(self, name: str) -> List[List[int]]:
        """All groups of one kind, each a sorted rank list; together they partition the world."""
        assert name in GROUP_NAMES, name
        if name == "world":
            return [list(range(self.world_size))]
        key_of = {
            "tp": lambda c: (c["pp"], c["dp"]),
            "dp": lambda c: (c["pp"], c["tp"]),
            "pp": lambda c: (c["dp"], c["tp"]),
            "esp": lambda c: (c["pp"], c["edp"], c["ep"]),
            "ep": lambda c: (c["pp"], c["edp"], c["esp"]),
            "ep_node": lambda c: (c["pp"], c["edp"], c["esp"], self.node_of(c["world"])),
            "ep_esp": lambda c: (c["pp"], c["edp"]),
            "edp": lambda c: (c["pp"], c["ep"], c["esp"]),
            # first and last stage of one local rank together; a middle stage's rank alone
            "embedding": lambda c: ((0, c["world"] % self.stage_size) if c["pp"] in (0, self.pipeline - 1)
                                    else (1, c["world"])),
        }[name]
        buckets: Dict[Any, List[int]] = {}
        for r in range(self.world_size):
            buckets.setdefault(key_of(self.coords(r)), []).append(r)
        return [buckets[k] for k in sorted(buckets)]

    def group_of(self, name: str, rank: int) -> List[int]:
        return next(g for g in self.groups(name) if rank in g)


@dataclass
class ParallelState:
    layout: RankLayout
    rank: int
    groups: Dict[str, Group] = field(default_factory=dict)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def build(cls, layout: RankLayout, rank: int, side_channels: Sequence[str] = ()) -> "ParallelState":
        """Create every group of every kind and keep the ones this rank belongs to; for each kind in
        `side_channels`, a second process group over the same ranks (`Group.side_handle`), warmed
        up at once (`warm_up_p2p`). All ranks call new_group in the same order, as torch.distributed
        requires (without use_local_synchronization, whose hashed names would collide for groups
        of equal ranks: a side channel, tp = esp). A group of one rank gets no process group (its
        collectives are no-ops; at ~1k ranks each new_group costs store round trips): every rank
        skips the same calls, since all compute the same layout."""
        state = cls(layout=layout, rank=rank)
        distributed = collectives.is_initialized()

        def new_group(ranks):
            return collectives.new_group(ranks) if distributed and len(ranks) > 1 else None

        for name in GROUP_NAMES:
            for ranks in layout.groups(name):
                handle = new_group(ranks)
                if rank in ranks:
                    device = collectives.backend_device(handle) if handle is not None else None
                    state.groups[name] = Group(name, ranks, ranks.index(rank), handle, layout.ranks_per_node,
                                               device=device)
        for name in sorted(side_channels):
            for ranks in layout.groups(name):
                handle = new_group(ranks)
                if rank in ranks:
                    state.groups[name].side_handle = handle
        for name in sorted(side_channels):
            warm_up_p2p(state.groups[name], side=True)
        return state

    @classmethod
    def single_process(cls) -> "ParallelState":
        return cls.build(RankLayout(world_size=1), rank=0)

    # -- accessors ----------------------------------------------------------------------------
    def __getattr__(self, item: str) -> Group:
        # state.tp, state.ep_esp, ... (only for group names; everything else is a normal attribute)
        groups = self.__dict__.get("groups", {})
        if item in groups:
            return groups[item]
        raise AttributeError(item)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def tp_size(self) -> int:
        return self.layout.tensor

    @property
    def pp_size(self) -> int:
        return self.layout.pipeline

    @property
    def ep_size(self) -> int:
        return self.layout.expert

    @property
    def esp_size(self) -> int:
        return self.layout.expert_shard

    @property
    def dp_size(self) -> int:
        return self.layout.data_parallel

    @property
    def edp_size(self) -> int:
        return self.layout.expert_data_parallel

    def describe(self) -> str:
        c = self.layout.coords(self.rank)
        return (f"rank {self.rank}/{self.world_size}: pp {c['pp']}/{self.pp_size} tp {c['tp']}/{self.tp_size} "
                f"dp {c['dp']}/{self.dp_size} "
                f"ep {c['ep']}/{self.ep_size} esp {c['esp']}/{self.esp_size} edp {c['edp']}/{self.edp_size}")
