"""vExpert moves: a new slot table reached by point-to-point transfers of whole experts, weights
and AdamW state (FlexMoE §3.3 Expand / Shrink / Migrate, §4 "Paralleled Operation Modification"
and "Best-Effort Adjustment"; EPLB's re-plans). `moe/vexperts.py` has the slot table and storage.

A rank's storage holds one row per expert it holds (`SlotTable.resident`), so a new table moves
only the experts a rank gains: each comes from a rank that held it before (`plan_transfers`), its
weights, `exp_avg`, `exp_avg_sq` (and, bf16 runs, its fp32 master) in one message (kind
"vexpert_move"). Everything else is local: an expert a rank keeps keeps its row however many
vExperts of it the rank has (Expand onto a rank that holds the expert shares the weights, §3.3:
"parameter sharing for intra-GPU communication"), a Shrink or a freed slot is a tag, and the rows
of experts a rank loses are dropped. Since every copy of an expert is identical, any old holder is
a valid source: any sequence of Expand / Shrink / Migrate collapses into the transfers between its
first and last table, which is how parallelizable moves merge (§4).

`MovesInFlight` issues one layer's round: every rank plans the same transfers, copies the rows it
sends (the state as of the optimizer step that produced them) and posts all its sends and receives
at once (`collectives.p2p_exchange`, asynchronous, tag `MOVE_TAG`, on ``ep``'s side channel when the
run built one: `moe.flexmoe.moves: best_effort` does, so that the next forward's collectives on
``ep`` neither queue behind the moves nor they behind them; FlexMoE §4 uses "a separate CUDA
stream"). `complete()` waits for them,
builds the new [R', ...] stacks (kept rows + received ones) and installs them: `p.data`, the
optimizer's state tensors, the bf16 main gradient (`model/precision.py` `resize_main_grad`) and
the table. `moe.flexmoe.moves: sync` completes at once, after the step; `best_effort` leaves the
round in flight until the layer's next forward (`MoELayer.forward` -> `Balancer.complete_moves`),
so it overlaps the optimizer steps of the other layers, the data loading and the forwards of
the layers before it. Nothing reads or writes a layer's expert state between its optimizer step
and its next forward (a checkpoint or the end of training completes the rounds first), so the
result is the same as sync's, bit for bit.

Memory while a round is in flight: the rows a rank sends (copies) and receives, and at
`complete()` the new stacks next to the old ones until they are installed.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.parallel_state import Group
from megatron_moe.model.precision import has_main_grad, resize_main_grad
from megatron_moe.moe.vexperts import resident_rows

MOVE_KIND = "vexpert_move"
MOVE_TAG = 2  # point-to-point tag of the moves (gloo matches messages by peer and tag; NCCL ignores it)
STATE_KEYS = ("exp_avg", "exp_avg_sq", "master")  # optimizer state with a parameter's shape


@dataclass(frozen=True)
class Transfer:
    """EP rank `dst_rank` gains `expert`, copied from EP rank `src_rank` (a holder before the round)."""

    expert: int
    src_rank: int
    dst_rank: int


def plan_transfers(old: np.ndarray, new: np.ndarray) -> List[Transfer]:
    """The transfers that turn placement `old` [ep, V] into `new`: every expert a rank holds in
    `new` and not in `old` comes from the old holder with the fewest transfers assigned so far
    (then the lowest rank); ranks ascending, experts ascending, so every rank plans the same list.
    Experts a rank keeps (in any slots), freed slots and dropped experts move nothing."""
    transfers: List[Transfer] = []
    sent = np.zeros(old.shape[0], dtype=np.int64)
    held = [set(resident_rows(old, q)) for q in range(old.shape[0])]
    for q in range(new.shape[0]):
        for e in resident_rows(new, q):
            if e in held[q]:
                continue
            holders = np.array([r for r in range(old.shape[0]) if e in held[r]])
            src = int(holders[np.argmin(sent[holders])])
            sent[src] += 1
            transfers.append(Transfer(e, src, q))
    return transfers


def state_entries(params: Sequence[torch.nn.Parameter],
                  optimizer: Optional[torch.optim.Optimizer]) -> List[Tuple[torch.nn.Parameter, Optional[str]]]:
    """The [R, ...] tensors a move carries, as (parameter, None: its data | an optimizer state
    key): each parameter, then its AdamW moments once they exist and, in bf16 runs, its fp32
    master (training/mixed_precision.py). The same list on every rank (every rank steps every
    parameter)."""
    entries: List[Tuple[torch.nn.Parameter, Optional[str]]] = [(p, None) for p in params]
    for p in params:
        st = optimizer.state.get(p, {}) if optimizer is not None else {}
        entries += [(p, key) for key in STATE_KEYS if key in st]
    return entries


def entry_tensor(entry, optimizer) -> torch.Tensor:
    p, key = entry
    return p.data if key is None else optimizer.state[p][key]


def install_rows(entries, tensors: Sequence[torch.Tensor], optimizer) -> None:
    """Put `tensors` (one per entry, [R', ...]) in place of the entries' tensors; each
    parameter's gradient is dropped (a stale shape: the next step starts from zero anyway) and
    its bf16 main gradient re-allocated to the new shape."""
    for (p, key), t in zip(entries, tensors):
        if key is None:
            p.data = t
        else:
            optimizer.state[p][key] = t
    for p in {id(p): p for p, _ in entries}.values():
        p.grad = None
        if has_main_grad(p):
            resize_main_grad(p)


class MovesInFlight:
    """One round of one layer's moves (module docstring). Construct it on every rank of ``ep``
    with the same tables, in the same order (it posts the transfers); `complete()` installs them."""

    def __init__(self, experts, new_slots: np.ndarray, optimizer: Optional[torch.optim.Optimizer], group: Group):
        table = experts.slot_table
        self.experts, self.optimizer, self.table = experts, optimizer, table
        self.new = table.checked(new_slots)
        if self.new.shape != table.shape:
            raise ValueError(f"vExpert slots {self.new.shape} do not match the layer's {table.shape}")
        self.transfers = plan_transfers(table.slots, self.new)
        me = table.ep_rank
        self.old_rows, self.new_rows = table.resident(me), resident_rows(self.new, me)
        self.entries = state_entries(experts.stacks(), optimizer)
        tensors = [entry_tensor(entry, optimizer) for entry in self.entries]
        self.widths = [math.prod(t.shape[1:]) for t in tensors]
        dtype = functools.reduce(torch.promote_types, [t.dtype for t in tensors])  # bf16 runs: fp32 (lossless)
        sends, recvs = [], []
        self.received: Dict[int, torch.Tensor] = {}
        for t in self.transfers:
            if t.src_rank == me:  # a copy: the state as of now, whatever happens to the rows later
                row = self.old_rows.index(t.expert)
                sends.append((t.dst_rank, torch.cat([x[row].reshape(-1).to(dtype) for x in tensors])))
            elif t.dst_rank == me:
                self.received[t.expert] = tensors[0].new_empty(sum(self.widths), dtype=dtype)
                recvs.append((t.src_rank, self.received[t.expert]))
        self.pending = C.p2p_exchange(sends, recvs, group, kind=MOVE_KIND, tag=MOVE_TAG, side=True)

    @property
    def crossed(self) -> int:
        """Transfers of the round (every one crosses ranks; every rank counts them all)."""
        return len(self.transfers)

    @torch.no_grad()
    def complete(self) -> None:
        """Wait for this rank's transfers, then install the new stacks and the new table."""
        self.pending.wait()
        if self.new_rows != self.old_rows:
            tensors = []
            for i, entry in enumerate(self.entries):
                old = entry_tensor(entry, self.optimizer)
                offset = sum(self.widths[:i])
                rows = [old[self.old_rows.index(e)] if e in self.old_rows else
                        self.received[e][offset: offset + self.widths[i]].view(old.shape[1:]).to(old.dtype)
                        for e in self.new_rows]
                tensors.append(torch.stack(rows) if rows else old.new_empty((0,) + tuple(old.shape[1:])))
            install_rows(self.entries, tensors, self.optimizer)
        self.table.slots = self.new
        self.received = {}


@torch.no_grad()
def reshape_storage(experts, new_slots: np.ndarray, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Install `new_slots` without moving anything: rows of experts the rank keeps stay, new rows
    are zero (a checkpoint load fills them next). With `optimizer`, its state tensors follow."""
    table = experts.slot_table
    new = table.checked(new_slots)
    old_rows, new_rows = table.resident(table.ep_rank), resident_rows(new, table.ep_rank)
    if new_rows != old_rows:
        entries = state_entries(experts.stacks(), optimizer)
        tensors = []
        for entry in entries:
            old = entry_tensor(entry, optimizer)
            out = old.new_zeros((len(new_rows),) + tuple(old.shape[1:]))
            for k, e in enumerate(new_rows):
                if e in old_rows:
                    out[k] = old[old_rows.index(e)]
            tensors.append(out)
        install_rows(entries, tensors, optimizer)
    table.slots = new


def fit_optimizer_rows(params: Sequence[torch.nn.Parameter], optimizer: Optional[torch.optim.Optimizer]) -> None:
    """After vExpert stacks changed their row count without the optimizer (`reshape_storage` by a
    checkpoint's balancer state): state tensors of another shape become zeros of the new one (the
    fp32 master: the parameter in fp32), main gradients follow. A checkpoint load fills them next."""
    if optimizer is None:
        return
    for p in (p for p in params if getattr(p, "varying_rows", False)):
        st = optimizer.state.get(p, {})
        for key in STATE_KEYS:
            if key in st and st[key].shape != p.shape:
                st[key] = p.detach().float() if key == "master" else torch.zeros_like(p, dtype=st[key].dtype)
        if has_main_grad(p) and p.main_grad.shape != p.shape:
            resize_main_grad(p)
