"""Placement: who computes which tokens of which expert this iteration (DESIGN.md §4).

Every balancer returns a Placement; every schedule executes one without knowing the policy:

* ``replicas[e]``: the EP ranks that compute expert e, its owner first. The owner of e is EP rank
  ``e // (E / ep)`` (expert weights are sharded contiguously over ``ep`` on dim 0). A "device" is
  an EP rank; replicating e to EP rank q means each ESP shard of e goes to shard rank j of q.
* ``routing_table[s, e, q]`` (Long[S, E, ep]): how many of source s's (kept) assignments to
  expert e are computed by EP rank q; zero unless q is a replica of e. What a "source" is belongs
  to the schedule: the baseline's all-to-all runs over ``ep`` after the ESP-AllGather, so its
  sources are the ``ep`` ranks (S = ep); Parm's S1/S2 send from every ``ep_esp`` rank.

Row order convention shared by all schedules: a source orders its rows by expert (ascending),
deals expert e's rows out to ``replicas[e]`` in replica order (``routing_table[s, e, q]`` each),
and sends to each EP rank its rows in that order. A receiver therefore gets, from each source,
blocks per expert in ascending expert order, and computes the experts ``experts_on(q)``.

Only the owner-only placement (`owner_only`) exists so far; FasterMoE shadowing, FlexMoE
vExperts and Pro-Prophet plans add replicas and split the counts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch


def owner_of(expert: int, num_experts: int, ep_size: int) -> int:
    """EP rank holding expert `expert`'s weights."""
    return expert // (num_experts // ep_size)


def _exclusive_cumsum(t: torch.Tensor) -> torch.Tensor:
    return t.cumsum(0) - t


@dataclass(frozen=True)
class Placement:
    replicas: Tuple[Tuple[int, ...], ...]  # [E] EP ranks computing expert e, owner first
    routing_table: torch.Tensor  # Long[S, E, ep]

    def __post_init__(self):
        table = self.routing_table
        assert table.dim() == 3 and table.shape[1] == len(self.replicas), tuple(table.shape)
        allowed = torch.zeros(table.shape[1:], dtype=torch.bool)  # [E, ep]
        for e, ranks in enumerate(self.replicas):
            allowed[e, list(ranks)] = True
        assert not table[:, ~allowed].any(), "routing_table sends tokens to a rank that is no replica"

    @classmethod
    def owner_only(cls, counts: torch.Tensor, ep_size: int) -> "Placement":
        """Every expert computed by its owner: counts Long[S, E] -> routing_table[s, e, owner(e)]."""
        num_sources, num_experts = counts.shape
        owners = [owner_of(e, num_experts, ep_size) for e in range(num_experts)]
        table = torch.zeros(num_sources, num_experts, ep_size, dtype=torch.long)
        table[:, torch.arange(num_experts), owners] = counts.long()
        return cls(tuple((q,) for q in owners), table)

    @property
    def ep_size(self) -> int:
        return self.routing_table.shape[2]

    def experts_on(self, q: int) -> List[int]:
        """Experts EP rank q computes (owned or replicated), ascending."""
        return [e for e, ranks in enumerate(self.replicas) if q in ranks]

    def send_splits(self, src: int) -> List[int]:
        """Rows source `src` sends to each EP rank [ep]."""
        return self.routing_table[src].sum(0).tolist()

    def recv_splits(self, q: int) -> List[int]:
        """Rows EP rank q receives from each source [S]."""
        return self.routing_table[:, :, q].sum(1).tolist()

    def expert_counts(self, q: int) -> List[int]:
        """Rows EP rank q computes for each expert of `experts_on(q)`."""
        return self.routing_table[:, self.experts_on(q), q].sum(0).tolist()

    def destinations(self, src: int) -> torch.Tensor:
        """Long[rows]: the EP rank computing each of source `src`'s rows, rows ordered by expert."""
        ranks, repeats = [], []
        for e, replicas in enumerate(self.replicas):
            for q in replicas:
                ranks.append(q)
                repeats.append(int(self.routing_table[src, e, q]))
        return torch.repeat_interleave(torch.tensor(ranks, dtype=torch.long), torch.tensor(repeats, dtype=torch.long))

    def receive_order(self, q: int) -> torch.Tensor:
        """Long[rows]: permutation of EP rank q's received rows (source-major, experts ascending
        within a source) into expert-major order (experts ascending, sources ascending within)."""
        blocks = self.routing_table[:, :, q]  # [S, E] rows per (source, expert)
        starts = _exclusive_cumsum(blocks.flatten()).view_as(blocks)  # offset of each block as received
        lengths, starts = blocks.t().flatten(), starts.t().flatten()  # expert-major block order
        within = torch.arange(int(lengths.sum())) - torch.repeat_interleave(_exclusive_cumsum(lengths), lengths)
        return torch.repeat_interleave(starts, lengths) + within

    def tokens_per_ep_rank(self) -> torch.Tensor:
        """Long[ep]: assignments each EP rank computes."""
        return self.routing_table.sum((0, 1))
