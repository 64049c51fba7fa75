"""Persistent vExperts: expert slots that hold whole experts with their own weights and AdamW state
(FlexMoE §3.1-3.3, `moe.balancer: flexmoe`; DeepSeek's EPLB, `moe.balancer: eplb`).

Unlike the per-iteration replicas of `moe/replicas.py` (FasterMoE, Pro-Prophet: Trans before
use, Agg after backward, the owner alone keeps optimizer state), a vExpert is persistent. Every EP
rank has V slots; `SlotTable.slots` Int[ep, V] says which expert each holds (-1: free), identical
on every rank. The expert parameters of a slot layer are local stacks [V, ...] (each ESP rank: its
shard of each slot's expert), so a slot's weights and AdamW moments live in the same rows of the
parameter and of its optimizer state.

* Compute: a rank computes each expert it holds once, with the first slot holding it
  (`SlotTable.compute_slots`); `Placement.on_slots` routes every expert's rows to its holders.
* Gradients (`sync_replica_grads`, before the data-parallel all-reduce): the slots of an expert
  sum their gradients (an all-reduce over ``ep`` of the replicated experts' gradients, kind
  "vexpert_grad") and every slot takes the sum: the gradient of one copy that computed all the
  expert's rows. Each slot then takes the same AdamW step, so the copies stay identical.
  The global grad norm counts every expert once (`canonical_mask`).
* Moves (`relocate`, after the optimizer step): a new table is reached from the old one by filling
  each cell whose expert changes from a cell that held that expert before (the same rank's when
  there is one), weights and both AdamW moments in one message, every transfer of a round posted
  together (kind "vexpert_move"). Since every copy of an expert is identical, any holder is a
  valid source: a sequence of Expand / Shrink / Migrate (FlexMoE §3.3) collapses into the
  transfers between its first and last placement, which is how parallelizable moves merge (§3.5).
* Checkpoints: one canonical chunk per expert under the global identity [E, ...]
  (`expert_rows`), whatever the slots hold; any layout and slot count loads it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.parallel_state import Group
from megatron_moe.model.precision import grad_buffer

MOVE_KIND = "vexpert_move"
GRAD_KIND = "vexpert_grad"


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
        """Experts EP rank q holds, ascending (once each)."""
        return sorted(set(self.slots[q][self.slots[q] >= 0].tolist()))

    def compute_slots(self, q: int) -> List[int]:
        """Slot of EP rank q that computes each of `resident(q)`: the first holding it."""
        row = self.slots[q].tolist()
        return [row.index(e) for e in self.resident(q)]

    def canonical_mask(self, q: int) -> torch.Tensor:
        """Bool[V]: the slots of EP rank q that are their expert's first copy in (rank, slot) order."""
        flat = self.slots.reshape(-1)
        _, first = np.unique(flat, return_index=True)
        mask = np.zeros(flat.size, dtype=bool)
        mask[first] = True
        mask &= flat >= 0
        return torch.from_numpy(mask.reshape(self.slots.shape)[q].copy())

    def copies(self) -> np.ndarray:
        """Int[E]: slots holding each expert."""
        return np.bincount(self.slots[self.slots >= 0], minlength=self.num_experts)

    @property
    def extra_vexperts(self) -> int:
        """vExperts beyond one per expert (`moe_replicas` of a slot layer)."""
        return int((self.slots >= 0).sum()) - self.num_experts


def expert_rows(table: SlotTable) -> List[Tuple[int, int]]:
    """[(local slot, global expert)]: this rank's one copy of each expert it holds (checkpoints
    save and load these; `fill_duplicates` copies them into further slots of the same expert)."""
    q = table.ep_rank
    return list(zip(table.compute_slots(q), table.resident(q)))


@torch.no_grad()
def fill_duplicates(table: SlotTable, tensors: Sequence[torch.Tensor]) -> None:
    """Copy each expert's first slot on this rank into its other slots on this rank ([V, ...] each)."""
    row = table.slots[table.ep_rank].tolist()
    for k, e in enumerate(row):
        if e >= 0 and row.index(e) != k:
            for t in tensors:
                t[k].copy_(t[row.index(e)])


# -- gradients ------------------------------------------------------------------------------------
@torch.no_grad()
def sync_replica_grads(params: Sequence[torch.nn.Parameter], table: SlotTable, group: Group) -> None:
    """Every slot of an expert held more than once gets the sum of the gradients of all its slots
    (all ranks of `group` = ``ep`` call this with the same table)."""
    copies = table.copies()
    shared = np.flatnonzero(copies > 1).tolist()
    if not shared:
        return
    row = table.slots[table.ep_rank]
    grads = [grad_buffer(p) for p in params]  # fp32 main_grad in bf16 runs (model/precision.py)
    width = sum(g[0].numel() for g in grads)
    buffer = grads[0].new_zeros(len(shared), width)  # [X, all parameters of one slot]
    for i, e in enumerate(shared):
        for k in np.flatnonzero(row == e).tolist():
            buffer[i] += torch.cat([g[k].reshape(-1) for g in grads])
    if group.size > 1:
        C.all_reduce(buffer, group, kind=GRAD_KIND)
    for i, e in enumerate(shared):
        for k in np.flatnonzero(row == e).tolist():
            offset = 0
            for g in grads:
                n = g[k].numel()
                g[k].copy_(buffer[i, offset: offset + n].view_as(g[k]))
                offset += n


# -- moves ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Transfer:
    """Fill cell (dst_rank, dst_slot) with `expert`, copied from (src_rank, src_slot) of the old table."""

    expert: int
    src_rank: int
    src_slot: int
    dst_rank: int
    dst_slot: int


def plan_transfers(old: np.ndarray, new: np.ndarray) -> List[Transfer]:
    """The transfers that turn placement `old` [ep, V] into `new`: every cell whose expert changes
    to a held one is filled from the same rank's copy when it had one, otherwise from the holder
    with the fewest transfers assigned so far (then the lowest rank). Cells that become free
    (Shrink) move nothing."""
    transfers: List[Transfer] = []
    sent = np.zeros(old.shape[0], dtype=np.int64)
    for q, k in zip(*np.nonzero((new != old) & (new >= 0))):
        e = int(new[q, k])
        if (old[q] == e).any():
            src = int(q)
        else:
            holders = np.flatnonzero((old == e).any(1))
            src = int(holders[np.argmin(sent[holders])])
            sent[src] += 1
        transfers.append(Transfer(e, src, int(np.flatnonzero(old[src] == e)[0]), int(q), int(k)))
    return transfers


@torch.no_grad()
def relocate(table: SlotTable, new_slots: np.ndarray, state_tensors: Sequence[torch.Tensor], group: Group) -> int:
    """Collective over ``ep``: move slot contents (each of `state_tensors` [V, ...]: parameters and
    their AdamW moments) so that they match `new_slots`, then install it in `table`. Returns the
    transfers that crossed ranks."""
    new = table.checked(new_slots)
    if new.shape != table.shape:
        raise ValueError(f"vExpert slots {new.shape} do not match the layer's {table.shape}")
    transfers = plan_transfers(table.slots, new)
    me = table.ep_rank

    def pack(k: int) -> torch.Tensor:  # a copy: the source cell may be overwritten by this round
        return torch.cat([t[k].reshape(-1) for t in state_tensors])

    def unpack(k: int, flat: torch.Tensor) -> None:
        offset = 0
        for t in state_tensors:
            n = t[k].numel()
            t[k].copy_(flat[offset: offset + n].view_as(t[k]))
            offset += n

    width = sum(t[0].numel() for t in state_tensors)
    dtype = functools.reduce(torch.promote_types, [t.dtype for t in state_tensors])  # bf16 runs: fp32 (lossless)
    sends, recvs, writes = [], [], []
    for t in transfers:
        if t.src_rank == me and t.dst_rank == me:
            writes.append((t.dst_slot, pack(t.src_slot)))
        elif t.src_rank == me:
            sends.append((t.dst_rank, pack(t.src_slot)))
        elif t.dst_rank == me:
            buffer = state_tensors[0].new_empty(width, dtype=dtype)
            recvs.append((t.src_rank, buffer))
            writes.append((t.dst_slot, buffer))
    C.p2p_exchange(sends, recvs, group, kind=MOVE_KIND).wait()
    for k, flat in writes:
        unpack(k, flat)
    table.slots = new
    return sum(1 for t in transfers if t.src_rank != t.dst_rank)


def optimizer_tensors(params: Sequence[torch.nn.Parameter],
                      optimizer: Optional[torch.optim.Optimizer]) -> List[torch.Tensor]:
    """The [V, ...] tensors a move carries: each parameter, then its AdamW moments once they exist
    and, in bf16 runs, its fp32 master (training/mixed_precision.py)."""
    tensors = [p.data for p in params]
    for p in params:
        st = optimizer.state.get(p, {}) if optimizer is not None else {}
        tensors += [st[key] for key in ("exp_avg", "exp_avg_sq", "master") if key in st]
    return tensors


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
