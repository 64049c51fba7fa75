"""Placement: who computes which tokens of which expert this iteration (DESIGN.md §4).

Every balancer returns a Placement; every schedule executes one without knowing the policy:

* ``replicas[e]``: the EP ranks that compute expert e, a rank holding its weights first. A
  "device" is an EP rank; replicating e to EP rank q means each ESP shard of e goes to shard rank
  j of q.
* ``resident[q]``: the experts whose weights EP rank q holds, ascending. By default (None) the
  owners': expert weights are sharded contiguously over ``ep`` on dim 0, so EP rank q holds
  ``[q E/ep, (q+1) E/ep)`` and the owner of e is ``e // (E / ep)``. Persistent vExperts
  (FlexMoE, EPLB: `moe/vexperts.py`) hold any experts in their slots; then `on_slots` builds
  the placement and every rank listed in ``replicas[e]`` holds e (nothing moves per iteration).
* ``routing_table[s, e, q]`` (Long[S, E, ep]): how many of source s's (kept) assignments to
  expert e are computed by EP rank q; zero unless q is a replica of e. What a "source" is belongs
  to the schedule: the baseline's all-to-all runs over ``ep`` after the ESP-AllGather, so its
  sources are the ``ep`` ranks (S = ep); Parm's S1/S2 send from every ``ep_esp`` rank.

Row order convention shared by all schedules: a source orders its rows by expert (ascending),
deals expert e's rows out to ``replicas[e]`` in replica order (``routing_table[s, e, q]`` each),
and sends to each EP rank its rows in that order. A receiver therefore gets, from each source,
blocks per expert in ascending expert order; `receive_order(q)` regroups them expert-major in the
order of ``experts_on(q)``: every expert q holds (``resident[q]``, ascending, also those with no
rows), then the experts it computes as a per-iteration replica (ascending). `Experts.forward`
computes that batch: the held stack first, then the replica weights `moe/replicas.py` moved in
(*Trans*).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch


def owner_of(expert: int, num_experts: int, ep_size: int) -> int:
    """EP rank holding expert `expert`'s weights."""
    return expert // (num_experts // ep_size)


def owned_experts(q: int, num_experts: int, ep_size: int) -> List[int]:
    """The experts EP rank q holds (contiguous: weights are sharded over ``ep`` on dim 0)."""
    per_rank = num_experts // ep_size
    return list(range(q * per_rank, (q + 1) * per_rank))


# (E, ep) -> the owners' layout, a function of the config alone, built once (a decode step plans
# every layer for a handful of tokens): ((owner(e),) per expert, resident, Long[E] experts, Long[E] owners)
_OWNER_LAYOUTS: Dict[Tuple[int, int], tuple] = {}


def _owner_layout(num_experts: int, ep_size: int) -> tuple:
    key = (num_experts, ep_size)
    if key not in _OWNER_LAYOUTS:
        owners = [owner_of(e, num_experts, ep_size) for e in range(num_experts)]
        resident = tuple(tuple(owned_experts(q, num_experts, ep_size)) for q in range(ep_size))
        _OWNER_LAYOUTS[key] = (tuple((q,) for q in owners), resident, torch.arange(num_experts),
                               torch.tensor(owners, dtype=torch.long))
    return _OWNER_LAYOUTS[key]


def owner_table(counts: torch.Tensor, ep_size: int) -> Tuple[Tuple[Tuple[int, ...], ...], torch.Tensor]:
    """`Placement.owner_only`'s replicas and routing table, unchecked, for a policy to edit:
    counts Long[S, E] -> ((owner(e),) per expert, Long[S, E, ep] with counts[s, e] at owner(e))."""
    num_sources, num_experts = counts.shape
    replicas, _, experts, owners = _owner_layout(num_experts, ep_size)
    table = torch.zeros(num_sources, num_experts, ep_size, dtype=torch.long)
    table[:, experts, owners] = counts.long()
    return replicas, table


def _exclusive_cumsum(t: torch.Tensor) -> torch.Tensor:
    return t.cumsum(0) - t


def expert_major_order(blocks: torch.Tensor, order: Sequence[int]) -> torch.Tensor:
    """Long[rows]: permutation of rows received as blocks (Long[senders, E]: rows per (sender,
    expert); sender-major, experts ascending within a sender) into expert-major order (experts as
    in `order`, senders ascending within an expert). Experts outside `order` must have no rows."""
    starts = _exclusive_cumsum(blocks.flatten()).view_as(blocks)  # offset of each block as received
    lengths, starts = blocks[:, order].t().flatten(), starts[:, order].t().flatten()  # expert-major blocks
    within = torch.arange(int(lengths.sum())) - torch.repeat_interleave(_exclusive_cumsum(lengths), lengths)
    return torch.repeat_interleave(starts, lengths) + within


@dataclass(frozen=True)
class Placement:
    replicas: Tuple[Tuple[int, ...], ...]  # [E] EP ranks computing expert e, a holder first
    routing_table: torch.Tensor  # Long[S, E, ep]
    resident: Optional[Tuple[Tuple[int, ...], ...]] = None  # [ep] experts each EP rank holds; None: owners

    def __post_init__(self):
        # checked with raise, not assert: a wrong placement computes wrong results (kept under -O)
        table, num_experts = self.routing_table, len(self.replicas)
        if table.dim() != 3 or table.shape[1] != num_experts:
            raise ValueError(f"Placement: routing_table {tuple(table.shape)} does not match {num_experts} experts")
        if self.resident is None:
            object.__setattr__(self, "resident", tuple(tuple(owned_experts(q, num_experts, table.shape[2]))
                                                       for q in range(table.shape[2])))
        elif len(self.resident) != table.shape[2] or any(list(r) != sorted(set(r)) for r in self.resident):
            raise ValueError(f"Placement: resident {self.resident} must list ascending experts for each of "
                             f"{table.shape[2]} EP ranks")
        pairs = [(e, q) for e, ranks in enumerate(self.replicas) for q in ranks]  # replica order
        held = {(q, e) for q, experts in enumerate(self.resident) for e in experts}
        for e, ranks in enumerate(self.replicas):
            if not ranks or (ranks[0], e) not in held or len(set(ranks)) != len(ranks):
                raise ValueError(f"Placement: replicas of expert {e} must list a rank holding it first, once "
                                 f"each: {ranks}")
        pair_experts, pair_ranks = torch.tensor(pairs, dtype=torch.long).t()
        # the pairs are distinct: no other entry is nonzero iff they hold every nonzero entry
        if torch.count_nonzero(table) != torch.count_nonzero(table[:, pair_experts, pair_ranks]):
            raise ValueError("Placement: routing_table sends tokens to a rank that is no replica")
        object.__setattr__(self, "_pairs", (pair_experts, pair_ranks))  # (expert, rank) in replica order

    @classmethod
    def owner_only(cls, counts: torch.Tensor, ep_size: int) -> "Placement":
        """Every expert computed by its owner: counts Long[S, E] -> routing_table[s, e, owner(e)].
        Valid by construction: the checks of `__post_init__` are skipped (the layout is cached)."""
        replicas, table = owner_table(counts, ep_size)
        _, resident, experts, owners = _owner_layout(counts.shape[1], ep_size)
        placement = object.__new__(cls)
        for name, value in (("replicas", replicas), ("routing_table", table), ("resident", resident),
                            ("_pairs", (experts, owners))):  # one replica per expert: (e, owner(e)) in order
            object.__setattr__(placement, name, value)
        return placement

    @classmethod
    def shadowed(cls, counts: torch.Tensor, ep_size: int, shadowed: Sequence[int],
                 source_ep_ranks: Sequence[int]) -> "Placement":
        """FasterMoE's dynamic shadowing (§4.1, Fig. 6): every expert in `shadowed` is replicated on
        every EP rank and each source computes its own rows of it where it sits
        (`source_ep_ranks[s]`); the other experts stay with their owners."""
        replicas, table = owner_table(counts, ep_size)
        replicas = list(replicas)
        local = torch.tensor(list(source_ep_ranks), dtype=torch.long)  # [S]
        for e in shadowed:
            owner = replicas[e][0]
            replicas[e] = (owner,) + tuple(q for q in range(ep_size) if q != owner)
            table[:, e] = 0
            table[torch.arange(counts.shape[0]), e, local] = counts[:, e].long()
        return cls(tuple(replicas), table)

    @classmethod
    def on_slots(cls, table: torch.Tensor, resident: Sequence[Sequence[int]]) -> "Placement":
        """Persistent vExperts (`moe/vexperts.py`): every expert computed where its weights are
        held (`resident[q]`: experts EP rank q holds), routing_table Long[S, E, ep] from the
        balancer's flexible routing; every holder of e is listed as a replica of e."""
        resident = tuple(tuple(sorted(set(int(e) for e in r))) for r in resident)
        holders = [[] for _ in range(table.shape[1])]
        for q, experts in enumerate(resident):
            for e in experts:
                holders[e].append(q)
        return cls(tuple(tuple(h) for h in holders), table, resident)

    @property
    def ep_size(self) -> int:
        return self.routing_table.shape[2]

    def experts_on(self, q: int) -> List[int]:
        """Experts EP rank q computes: all it holds (ascending), then its per-iteration replicas
        (ascending)."""
        return list(self.resident[q]) + self.replicas_on(q)

    def replicas_on(self, q: int) -> List[int]:
        """Experts EP rank q computes without holding them (their weights come by *Trans*), ascending."""
        return [e for e, ranks in enumerate(self.replicas) if q in ranks[1:] and e not in self.resident[q]]

    def transient_replicas(self) -> Tuple[Tuple[int, ...], ...]:
        """`replicas` without the ranks that hold the expert themselves (besides the first): what
        *Trans* must move (`moe/replicas.py`); equal to `replicas` under the owners' layout."""
        return tuple((ranks[0],) + tuple(q for q in ranks[1:] if e not in self.resident[q])
                     for e, ranks in enumerate(self.replicas))

    @property
    def num_replicas(self) -> int:
        """EP ranks computing an expert beyond one per expert (FasterMoE's shadows, Pro-Prophet's
        placements, vExperts on several ranks)."""
        return sum(len(ranks) - 1 for ranks in self.replicas)

    def send_splits(self, src: int) -> List[int]:
        """Rows source `src` sends to each EP rank [ep]."""
        return self.routing_table[src].sum(0).tolist()

    def recv_splits(self, q: int) -> List[int]:
        """Rows EP rank q receives from each source [S]."""
        return self.routing_table[:, :, q].sum(1).tolist()

    def expert_counts(self, q: int) -> List[int]:
        """Rows EP rank q computes for each expert of `experts_on(q)`."""
        return self.routing_table[:, self.experts_on(q), q].sum(0).tolist()

    def expert_counts_from(self, q: int, sources: Sequence[int]) -> List[int]:
        """Rows EP rank q computes for each expert of `experts_on(q)` from `sources` only."""
        return self.routing_table[list(sources)][:, self.experts_on(q), q].sum(0).tolist()

    def destinations(self, src: int) -> torch.Tensor:
        """Long[rows]: the EP rank computing each of source `src`'s rows, rows ordered by expert."""
        pair_experts, pair_ranks = self._pairs
        return torch.repeat_interleave(pair_ranks, self.routing_table[src, pair_experts, pair_ranks])

    def receive_order(self, q: int) -> torch.Tensor:
        """Long[rows]: permutation of EP rank q's received rows (source-major, experts ascending
        within a source) into expert-major order (experts as in `experts_on(q)`, sources ascending
        within an expert)."""
        return self.receive_order_from(q, range(self.routing_table.shape[0]))

    def receive_order_from(self, q: int, sources: Sequence[int]) -> torch.Tensor:
        """`receive_order` of the rows EP rank q receives from `sources` only, concatenated in that
        order (FasterMoE's smart schedule computes one group of sources at a time)."""
        return expert_major_order(self.routing_table[list(sources), :, q], self.experts_on(q))

    def source_rows(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(Long[S, E]: each source's rows per expert, Long[S, ep]: rows each source sends to each
        EP rank), read from the (expert, rank) pairs alone: every other entry is zero (checked on
        construction), so the [S, E, ep] table is not swept."""
        pair_experts, pair_ranks = self._pairs
        rows = self.routing_table[:, pair_experts, pair_ranks]  # [S, P]
        per_expert = rows.new_zeros(rows.shape[0], len(self.replicas)).index_add_(1, pair_experts, rows)
        return per_expert, rows.new_zeros(rows.shape[0], self.ep_size).index_add_(1, pair_ranks, rows)

    def tokens_per_ep_rank(self) -> torch.Tensor:
        """Long[ep]: assignments each EP rank computes."""
        return self.routing_table.sum((0, 1))
