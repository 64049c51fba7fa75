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
  expert sum their rows' gradients among themselves (point to point: each sends its row to the
  expert's root holder, which sums them in rank order and sends the sum back; kind
  "vexpert_grad"; FlexMoE Eq. 9 prices it so) and every holder takes the sum: the gradient of one
  copy that computed all the expert's rows. Ranks that do not hold an expert take no part in it. Each copy then takes the same AdamW step, so the copies stay
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
def grad_sum_roots(slots: np.ndarray, num_experts: int) -> List[Tuple[int, int, List[int]]]:
    """[(expert, root, holders ascending)] of every expert several EP ranks hold in `slots`
    [ep, V], ascending by expert: the root that sums its gradient is holder ``e mod holders``
    of its holders, so that the roots spread over the ranks (not every sum on the lowest rank)."""
    held = holders(slots, num_experts)
    out = []
    for e in np.flatnonzero(held.sum(0) > 1).tolist():
        ranks = np.flatnonzero(held[:, e]).tolist()
        out.append((e, ranks[e % len(ranks)], ranks))
    return out


def grad_sum_traffic(slots: np.ndarray, num_experts: int, width: int) -> np.ndarray:
    """Float[ep, ep]: elements EP rank i sends rank j in round 1 of `sync_replica_grads`, one
    expert's gradient being `width` elements: every non-root holder sends the root its row.
    Round 2 (the root sends each of them the sum) is its transpose."""
    P = np.zeros((slots.shape[0],) * 2)
    for _, root, ranks in grad_sum_roots(slots, num_experts):
        P[[q for q in ranks if q != root], root] += width
    return P


@torch.no_grad()
def sync_replica_grads(params: Sequence[torch.nn.Parameter], table: SlotTable, group: Group) -> None:
    """Every rank holding an expert that several ranks hold gets the sum of their gradients of it
    (all ranks of `group` = ``ep`` call this with the same table). One row per expert and rank:
    a rank's several vExperts of an expert already share one gradient.

    Among the expert's holders only (FlexMoE Eq. 9 prices a replica's gradient synchronization
    among its holders, charged to them): in round 1 every holder but the expert's root
    (`grad_sum_roots`) sends the root its row; the root adds the holders' rows in ascending rank
    order and, in round 2, sends each of them the sum, so every holder ends with the same bits
    (the copies take the same AdamW step and stay identical). A rank's messages to one peer in a
    round are one tensor (its experts for that peer, ascending). Point to point through
    `collectives.p2p_exchange` (kind "vexpert_grad", tags `GRAD_TAGS`); a rank that holds no
    replicated expert sends and receives nothing."""
    me = group.rank
    mine = [(e, root, ranks) for e, root, ranks in grad_sum_roots(table.slots, table.num_experts) if me in ranks]
    if not mine or group.size == 1:
        return
    rows = {e: k for k, e in expert_rows(table)}
    grads = [grad_buffer(p) for p in params]  # fp32 main_grad in bf16 runs (model/precision.py)
    width = sum(math.prod(g.shape[1:]) for g in grads)

    def row(e: int) -> torch.Tensor:
        return torch.cat([g[rows[e]].reshape(-1) for g in grads])

    to_root: Dict[int, List[int]] = defaultdict(list)  # root -> experts this rank sends it
    from_holder: Dict[int, List[int]] = defaultdict(list)  # holder -> experts this rank roots
    for e, root, ranks in mine:
        if root != me:
            to_root[root].append(e)
        else:
            for q in ranks:
                if q != me:
                    from_holder[q].append(e)
    sends = [(r, torch.stack([row(e) for e in es])) for r, es in sorted(to_root.items())]
    recvs = [(q, grads[0].new_empty(len(es), width)) for q, es in sorted(from_holder.items())]
    C.p2p_exchange(sends, recvs, group, kind=GRAD_KIND, tag=GRAD_TAGS[0]).wait()
    parts = {(q, e): buf[i] for (q, buf) in recvs for i, e in enumerate(from_holder[q])}
    sums = {}
    for e, root, ranks in mine:
        if root == me:
            total = None
            for q in ranks:  # fixed order: ascending holder rank
                part = row(e) if q == me else parts[(q, e)]
                total = part.clone() if total is None else total.add_(part)
            sums[e] = total
    sends = [(q, torch.stack([sums[e] for e in es])) for q, es in sorted(from_holder.items())]
    recvs = [(r, grads[0].new_empty(len(es), width)) for r, es in sorted(to_root.items())]
    C.p2p_exchange(sends, recvs, group, kind=GRAD_KIND, tag=GRAD_TAGS[1]).wait()
    sums.update({e: buf[i] for (r, buf) in recvs for i, e in enumerate(to_root[r])})
    for e, total in sums.items():
        offset = 0
        for g in grads:
            n = g[rows[e]].numel()
            g[rows[e]].copy_(total[offset: offset + n].view_as(g[rows[e]]))
            offset += n


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
