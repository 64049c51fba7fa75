"""Persistent vExperts: expert slots that hold whole experts with their weights and AdamW state
(FlexMoE §3.1-3.3, `moe.balancer: flexmoe`; DeepSeek's EPLB, `moe.balancer: eplb`).

Unlike the per-iteration replicas of `moe/replicas.py` (FasterMoE, Pro-Prophet: Trans before
use, Agg after backward, the owner alone keeps optimizer state), a vExpert is persistent. Every EP
rank has V slots; `SlotTable.slots` Int[ep, V] says which expert each holds (-1: free), identical
on every rank. The slots are the planner's unit (FlexMoE §3.2: an expert's tokens are split evenly
over its vExperts, so a rank holding k vExperts of e computes k shares of e's tokens).

* Storage (FlexMoE §3.1: "each vExpert shares weights with other vExperts for the same expert on
  the same GPU"): the expert parameters of a slot layer are local stacks [R, ...] with one row per
  expert the rank holds (`SlotTable.resident`, ascending; each ESP rank: its shard), whatever the
  number of its vExperts: k vExperts of one expert on a rank are one row of the parameter, one row
  of each AdamW moment, and one gradient, which sums the rows of all k (the rank computes the
  expert once, on every row routed to any of them). A free slot holds nothing. Extra vExperts of an
  expert change a rank's compute share, not its memory; a rank's expert memory is its distinct
  experts (at most V). The row count changes when a move changes the rank's experts
  (`moe/vexpert_moves.py`).
* Compute: `Placement.on_slots` routes every expert's rows to its holders; a rank runs its
  stacks as they are (all rows, in order).
* Gradients (`sync_replica_grads`, before the data-parallel all-reduce): the ranks holding an
  expert sum their rows' gradients among themselves (point to point: a reduce-scatter, each
  holder summing one chunk in rank order, then an all-gather of the sums; kind "vexpert_grad";
  FlexMoE Eq. 9 prices it so) and every holder takes the sum: the gradient of one copy that
  computed all the expert's rows. Ranks that do not hold an expert take no part in it. Each copy then takes the same AdamW step, so the copies stay
  identical. The global grad norm counts every expert once (`canonical_rows`).
* Moves: `moe/vexpert_moves.py` (after the optimizer step; synchronous, or best-effort: in flight
  until the layer's next forward).
* Checkpoints: one canonical chunk per expert under the global identity [E, ...]
  (`expert_rows`), whatever the slots hold; any layout and slot count loads it.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch

from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.parallel_state import Group
from megatron_moe.model.precision import grad_buffer

GRAD_KIND = "vexpert_grad"
GRAD_TAGS = (3, 4)  # point-to-point tags of the gradient sum's two rounds (vexpert_moves.MOVE_TAG is 2)


def resident_rows(slots: np.ndarray, q: int) -> List[int]:
    """Experts EP rank q holds in `slots` [ep, V], ascending, once each."""
    return sorted(set(slots[q][slots[q] >= 0].tolist()))


def holders(slots: np.ndarray, num_experts: int) -> np.ndarray:
    """Bool[ep, E]: whether EP rank q holds expert e in `slots` [ep, V] (in one slot or several)."""
    held = np.zeros((slots.shape[0], num_experts), dtype=bool)
    ranks, cells = np.nonzero(slots >= 0)
    held[ranks, slots[ranks, cells]] = True
    return held


class SlotTable:
    """slots Int[ep, V]: the expert each vExpert slot of each EP rank holds (-1: free)."""

    def __init__(self, slots: np.ndarray, num_experts: int, ep_rank: int):
        self.num_experts, self.ep_rank = num_experts, ep_rank
        self.slots = self.checked(slots)

    @classmethod
    def initial(cls, num_experts: int, ep_size: int, slots_per_rank: int, ep_rank: int) -> "SlotTable":
        """Rank q's first E/ep slots hold its experts of the owners' layout, the rest are free."""
        per_rank = num_experts // ep_size
        slots = np.full((ep_size, slots_per_rank), -1, dtype=np.int64)
        slots[:, :per_rank] = np.arange(num_experts).reshape(ep_size, per_rank)
        return cls(slots, num_experts, ep_rank)

    def checked(self, slots) -> np.ndarray:
        slots = np.array(slots, dtype=np.int64)
        if slots.ndim != 2 or slots.min() < -1 or slots.max() >= self.num_experts:
            raise ValueError(f"vExpert slots must be [ep, V] expert ids in [-1, {self.num_experts}): {slots.tolist()}")
        missing = np.setdiff1d(np.arange(self.num_experts), slots)
        if missing.size:
            raise ValueError(f"vExpert slots {slots.tolist()} leave experts {missing.tolist()} without a copy")
        return slots

    @property
    def shape(self) -> Tuple[int, int]:
        return self.slots.shape

    def resident(self, q: int) -> List[int]:
        """Experts EP rank q holds, ascending (once each): the rows of its parameter stacks."""
        return resident_rows(self.slots, q)

    def holders(self) -> np.ndarray:
        """Bool[ep, E]: whether EP rank q holds expert e (in one slot or several)."""
        return holders(self.slots, self.num_experts)

    def canonical_rows(self, q: int) -> torch.Tensor:
        """Bool[len(resident(q))]: the rows of EP rank q whose expert no lower rank holds (its
        first copy in rank order; the gradient norm counts these)."""
        held = self.holders()
        first = held.argmax(0)  # [E] lowest rank holding each expert (every expert has one)
        return torch.tensor([int(first[e]) == q for e in self.resident(q)], dtype=torch.bool)

    def copies(self) -> np.ndarray:
        """Int[E]: vExperts (slots) of each expert."""
        return np.bincount(self.slots[self.slots >= 0], minlength=self.num_experts)

    @property
    def extra_vexperts(self) -> int:
        """vExperts beyond one per expert (`moe_replicas` of a slot layer)."""
        return int((self.slots >= 0).sum()) - self.num_experts


def expert_rows(table: SlotTable) -> List[Tuple[int, int]]:
    """[(local row, global expert)]: this rank's one copy of each expert it holds (checkpoints
    save and load these, initialization fills them)."""
    return list(enumerate(table.resident(table.ep_rank)))


# -- gradients ------------------------------------------------------------------------------------
def grad_sum_plan(slots: np.ndarray, num_experts: int) -> List[Tuple[int, List[int]]]:
    """[(expert, holders ascending)] of every expert several EP ranks hold in `slots` [ep, V],
    ascending by expert."""
    held = holders(slots, num_experts)
    return [(e, np.flatnonzero(held[:, e]).tolist()) for e in np.flatnonzero(held.sum(0) > 1).tolist()]


def grad_chunks(expert: int, ranks: Sequence[int], width: int) -> List[Tuple[int, int, int]]:
    """[(start, stop, root)]: an expert's gradient of `width` elements cut into one chunk per
    holder (`ranks`, ascending; the first width mod k chunks one element longer), chunk j summed
    by holder (expert + j) mod k, so every holder sums one chunk (a reduce-scatter and all-gather
    among the holders) and the longer chunks fall on different ranks for different experts."""
    k = len(ranks)
    sizes = [width // k + (j < width % k) for j in range(k)]
    starts = np.cumsum([0] + sizes).tolist()
    return [(starts[j], starts[j + 1], ranks[(expert + j) % k]) for j in range(k)]


def grad_sum_traffic(slots: np.ndarray, num_experts: int, width: int) -> np.ndarray:
    """Float[ep, ep]: elements EP rank i sends rank j in round 1 of `sync_replica_grads`, one
    expert's gradient being `width` elements: every holder sends each chunk's root its part of
    that chunk. Round 2 (each root sends every other holder its summed chunk) is its transpose."""
    P = np.zeros((slots.shape[0],) * 2)
    for e, ranks in grad_sum_plan(slots, num_experts):
        for start, stop, root in grad_chunks(e, ranks, width):
            P[[q for q in ranks if q != root], root] += stop - start
    return P


Chunk = Tuple[int, int, int]  # (expert, start, stop) of one expert's flat gradient row


@torch.no_grad()
def sync_replica_grads(params: Sequence[torch.nn.Parameter], table: SlotTable, group: Group) -> None:
    """Every rank holding an expert that several ranks hold gets the sum of their gradients of it
    (all ranks of `group` = ``ep`` call this with the same table). One row per expert and rank:
    a rank's several vExperts of an expert already share one gradient.

    Among the expert's k holders only, as FlexMoE's Eq. 9 prices a replica's gradient
    synchronization (an all-reduce among its holders, charged to them): the gradient row is cut
    into k chunks, each with a root holder (`grad_chunks`). Round 1: every holder sends each
    chunk's root its part of the chunk; the root adds the holders' parts in ascending rank order.
    Round 2: the root sends every other holder the summed chunk. Every holder ends with the same
    bits (the copies take the same AdamW step and stay identical), having sent and received
    2 (k - 1) / k of one expert's gradient: a ring all-reduce's volume, Eq. 9's. A rank's messages
    to one peer in a round are one tensor (experts ascending, then chunks). Point to point through
    `collectives.p2p_exchange` (kind "vexpert_grad", tags `GRAD_TAGS`); a rank that holds no
    replicated expert sends and receives nothing."""
    me = group.rank
    mine = [(e, ranks) for e, ranks in grad_sum_plan(table.slots, table.num_experts) if me in ranks]
    if not mine or group.size == 1:
        return
    local = {e: k for k, e in expert_rows(table)}
    grads = [grad_buffer(p) for p in params]  # fp32 main_grad in bf16 runs (model/precision.py)
    width = sum(math.prod(g.shape[1:]) for g in grads)
    rows = {e: torch.cat([g[local[e]].reshape(-1) for g in grads]) for e, _ in mine}
    to_root: Dict[int, List[Chunk]] = defaultdict(list)  # root -> chunks this rank sends it its part of (round 1)
    from_holder: Dict[int, List[Chunk]] = defaultdict(list)  # holder -> chunks this rank sums, its part (round 1)
    for e, ranks in mine:
        for start, stop, root in grad_chunks(e, ranks, width):
            if root != me:
                to_root[root].append((e, start, stop))
                continue
            for q in ranks:
                if q != me:
                    from_holder[q].append((e, start, stop))
    # round 1: the holders' parts to each chunk's root
    parts = _exchange({r: [rows[e][a:b] for e, a, b in cs] for r, cs in to_root.items()}, from_holder, rows, group,
                      GRAD_TAGS[0])
    summed = {}
    for e, ranks in mine:
        for a, b, root in grad_chunks(e, ranks, width):
            if root == me:  # fixed order: ascending holder rank
                mine_or_theirs = [rows[e][a:b] if q == me else parts[(q, e, a, b)] for q in ranks]
                total = mine_or_theirs[0].clone()
                for part in mine_or_theirs[1:]:
                    total.add_(part)
                summed[(e, a, b)] = total
    # round 2: each root's sums back to the other holders
    totals = _exchange({q: [summed[c] for c in cs] for q, cs in from_holder.items()}, to_root, rows, group,
                       GRAD_TAGS[1])
    summed.update({(e, a, b): t for (_, e, a, b), t in totals.items()})
    for e, ranks in mine:
        row = torch.cat([summed[(e, a, b)] for a, b, _ in grad_chunks(e, ranks, width)])
        for g, piece in zip(grads, row.split([g[local[e]].numel() for g in grads])):
            g[local[e]].copy_(piece.view_as(g[local[e]]))


def _exchange(sends: Dict[int, List[torch.Tensor]], receives: Dict[int, List[Chunk]], rows, group: Group,
              tag: int) -> Dict[Tuple[int, int, int, int], torch.Tensor]:
    """One round of `sync_replica_grads`: to each peer its pieces as one tensor, from each peer
    its `receives` chunks (one tensor, in that order) -> {(peer, expert, start, stop): chunk}."""
    like = next(iter(rows.values()))
    recvs = [(q, like.new_empty(sum(b - a for _, a, b in cs))) for q, cs in sorted(receives.items())]
    C.p2p_exchange([(r, torch.cat(pieces)) for r, pieces in sorted(sends.items())], recvs, group, kind=GRAD_KIND,
                   tag=tag).wait()
    return {(q, *c): piece for q, buf in recvs
            for c, piece in zip(receives[q], buf.split([b - a for _, a, b in receives[q]]))}


# -- routing --------------------------------------------------------------------------------------
def integer_routing(values: np.ndarray, counts: np.ndarray, experts: np.ndarray, ranks: np.ndarray,
                    ep_size: int) -> torch.Tensor:
    """Rows per (expert, holder) pair, Float[S, P] (source s's rows of expert experts[p] for rank
    ranks[p], pairs ascending by (expert, rank), summing to counts[s, e] over e's pairs) ->
    Long[S, E, ep] with the same sums: floors, then the remaining rows one each to the largest
    fractional parts among e's pairs (ties: the lower rank); every other (expert, rank) gets
    nothing. Computed per pair, O(S P). Deterministic, so every rank computes the same table."""
    experts, ranks = np.asarray(experts, dtype=np.int64), np.asarray(ranks, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    num_sources, num_experts = counts.shape
    key = experts * ep_size + ranks
    if (np.diff(key) <= 0).any():
        raise ValueError("integer_routing: (expert, rank) pairs must be unique and ascending")
    values = np.maximum(values, 0.0)  # [S, P]
    table = np.floor(values).astype(np.int64)  # [S, P]
    first = np.flatnonzero(np.diff(experts, prepend=-1))  # each expert's first pair
    held = experts[first]  # [E'] experts with a pair
    placed = np.zeros((num_sources, num_experts), dtype=np.int64)
    if first.size:
        placed[:, held] = np.add.reduceat(table, first, axis=1)
    remainder = counts - placed  # [S, E] rows still to place
    if (remainder > 0).any():
        rest = values - table  # [S, P] fractional parts
        sizes = np.diff(np.append(first, experts.size))  # pairs per expert
        for k in np.unique(sizes).tolist():  # experts with k holders at once: [S, E_k, k]
            pairs = first[sizes == k, None] + np.arange(k)  # [E_k, k], ranks ascending
            order = np.argsort(-rest[:, pairs], axis=2, kind="stable")  # best pair first
            rank_in_order = np.argsort(order, axis=2, kind="stable")
            table[:, pairs] += rank_in_order < remainder[:, experts[pairs[:, 0]], None]
    out = np.zeros((num_sources, num_experts, ep_size), dtype=np.int64)
    out[:, experts, ranks] = table
    if (out.sum(2) != counts).any():
        raise RuntimeError("vExpert routing did not place every row on a rank holding its expert")
    return torch.from_numpy(out)
