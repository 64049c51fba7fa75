"""FlexMoE's vExpert cost model and policy maker as pure numpy planning (issue 11).

Nie et al., "FlexMoE: Scaling Large-scale Sparse Pre-trained Model Training via Dynamic Device
Placement" (SIGMOD'23), §3 (paper copy: shared/papers/002_9e9d849ca3726c8e.txt).

A placement is `slots` Int[G, V]: the expert each of the V vExpert slots of each of the G GPUs
(EP ranks) holds, -1 for a free slot. An expert's tokens are split evenly over its vExperts (§3.2);
vExperts of one expert on one GPU share one copy of its weights. Token counts are `counts`
[G, E]: the tokens GPU g's gate sends to expert e (the I_{e,g} of Alg. 3).

    balance_ratio         Eq. 6: max over GPUs of the tokens computed there / their mean
    flexible_routing      Alg. 3: local vExperts first, the rest in proportion to free capacity
    FlexCostModel         Eq. 5, 7-9 and the adjustment cost of §3.4
    StepCosts             Eq. 5 per GPU by expert column: a plan re-prices the columns it changes
    make_scheduling_plan  Alg. 2 as printed: expand the busiest expert, shrink the idlest, if Eq. 5
                          gains (`moe.flexmoe.policy: printed`; the default is flexmoe_policy.py)
    propose_migration     Alg. 1 line 9: swap a replicated expert's vExpert onto another of its GPUs
    schedule              Alg. 1 for one monitoring step: the ops to apply, in order
    apply_ops             executes Expand / Shrink / Migrate (§3.3) on a placement
    net_primitives        the ops without Expand / Shrink pairs that cancel (what is counted and priced)

Where this departs from the paper, and why:
  * Eq. 8 and 9 use one profiled bandwidth for all GPU pairs; the all-reduce of Eq. 9 is priced
    as a ring over the k GPUs holding the expert, 2 (k - 1) / k x its gradients (the paper looks
    BPS up per device group); the trainer runs it among those k GPUs only (`moe/vexperts.py`
    `sync_replica_grads`: a reduce-scatter and an all-gather of one chunk per holder, point to
    point, the ring's volume in 2 rounds instead of 2 (k - 1) steps);
  * Alg. 2 accepts a plan only if t1 + (its transfer cost) / `amortize_steps` < t0, which is how
    "we also consider the cost of expert adjustments" is read here; it tries every GPU for the
    new vExpert and every GPU holding e1 for the shrink and keeps the cheapest (the paper leaves
    where open); e1 is the idlest expert other than e0 that still has two vExperts, and with a
    free slot an Expand alone is a candidate too (the paper's placements have no free slots);
  * not a departure: Alg. 2 considers e0 = argmax cap_e only (line 6) and returns {} when no
    plan for it lowers Eq. 5 (lines 8-10), so Alg. 1 stops (lines 5-6) once the slowest GPU holds
    no vExpert of e0, even where expanding that GPU's own expert would gain; this follows the
    paper as printed (`moe.flexmoe.policy: printed`); the default, `flexmoe_policy.straggler_plan`
    with `escape_plan`, is a local search in FlexMoE's spirit, not Alg. 2 (its docstring lists
    each way it departs);
  * Alg. 1 line 9 "Modify Expert Placement with Migrate" is made concrete as greedy swaps that
    move a vExpert of a replicated expert onto a GPU already holding that expert, while Eq. 5
    plus transfer cost predicts a gain (fewer GPUs to sync, or fewer tokens crossing GPUs);
  * Alg. 3 line 7-9 write "min(...) - I" for the free capacity, negative as printed; it is read
    as capacity - local use, which makes every vExpert end with exactly cap_e tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np


@dataclass(frozen=True)
class Expand:
    """Add a vExpert of `expert` in the free slot (dst_rank, dst_slot), copied from src_rank."""
    expert: int
    src_rank: int
    dst_rank: int
    dst_slot: int


@dataclass(frozen=True)
class Shrink:
    """Free the slot (rank, slot) holding a vExpert of `expert` (a tag, no communication)."""
    expert: int
    rank: int
    slot: int


@dataclass(frozen=True)
class Migrate:
    """Exchange the vExpert of `expert` at (src_rank, src_slot) with whatever (dst_rank, dst_slot) holds."""
    expert: int
    src_rank: int
    src_slot: int
    dst_rank: int
    dst_slot: int


Op = Union[Expand, Shrink, Migrate]


def _check_slots(slots: np.ndarray, num_experts: int) -> np.ndarray:
    slots = np.asarray(slots)
    if slots.ndim != 2 or slots.size == 0 or not np.issubdtype(slots.dtype, np.integer):
        raise ValueError(f"slots must be a non-empty 2-D int array [G, V], got {slots.dtype} {slots.shape}")
    if slots.min() < -1 or slots.max() >= num_experts:
        raise ValueError(f"slots must hold expert ids in [0, {num_experts}) or -1 for a free slot")
    missing = np.setdiff1d(np.arange(num_experts), slots)
    if missing.size:
        raise ValueError(f"experts {missing.tolist()} have no vExpert: every expert needs at least one")
    return slots


def _check_counts(counts: np.ndarray, rows: int) -> np.ndarray:
    counts = np.asarray(counts, dtype=np.float64)
    if counts.ndim != 2 or counts.shape[0] != rows:
        raise ValueError(f"counts must be [{rows}, E] (one row per GPU / source), got shape {counts.shape}")
    if not np.all(np.isfinite(counts)) or np.any(counts < 0):
        raise ValueError("counts must be finite and non-negative")
    return counts


def vexpert_counts(slots: np.ndarray, num_experts: int) -> np.ndarray:
    """Int[G, E]: n_{e,g}, the vExperts of expert e on GPU g."""
    slots = _check_slots(slots, num_experts)
    n = np.zeros((slots.shape[0], num_experts), dtype=np.int64)
    ranks, cols = np.nonzero(slots >= 0)
    np.add.at(n, (ranks, slots[ranks, cols]), 1)
    return n


def rank_tokens(tokens: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """tokens [E] -> Float[G]: tokens each GPU computes when every vExpert of e gets I_e / n_e (§3.2)."""
    tokens = np.asarray(tokens, dtype=np.float64)
    n = vexpert_counts(slots, tokens.size)
    return n @ (tokens / n.sum(0))


def balance_ratio(tokens: np.ndarray, slots: np.ndarray) -> float:
    """Eq. 6: max_g (tokens GPU g computes) / (all tokens / |G|); 1.0 when balanced or all zero.
    Alg. 3 routing gives every GPU the same tokens as the even split used here."""
    load = rank_tokens(tokens, slots)
    mean = load.mean()
    return float(load.max() / mean) if mean > 0 else 1.0


class PairRouting(NamedTuple):
    """Alg. 3's routing on the (expert, holder) pairs, ascending by (expert, GPU): values[s, p]
    tokens source s sends to the vExperts of expert experts[p] on GPU ranks[p]. Every other
    (expert, GPU) gets nothing, so this is the dense [S, E, G] table without its zeros."""
    experts: np.ndarray  # Int[P]
    ranks: np.ndarray  # Int[P]
    values: np.ndarray  # Float[S, P]


def _alg3(counts: np.ndarray, source_ranks: np.ndarray, slots: np.ndarray):
    """Alg. 3 per (GPU, expert), each [G, E]: n_{e,g}, I_{e,g} (tokens GPU g's sources send to e),
    cap_e n_{e,g} (line 5's capacity), what stays local (line 5), the spill s_e (line 6) and each
    GPU's share of the spill (lines 7-10: free capacity / all free capacity of e)."""
    num_ranks, num_experts = slots.shape[0], counts.shape[1]
    n = vexpert_counts(slots, num_experts)  # [G, E]
    sent = np.zeros((num_ranks, num_experts))
    np.add.at(sent, source_ranks, counts)  # I_{e,g} [G, E]
    capacity = n * (sent.sum(0) / n.sum(0))  # cap_e n_{e,g} [G, E]
    local = np.minimum(capacity, sent)  # line 5
    spill = sent - local  # line 6: s_e
    free = capacity - local  # lines 7-9: c_{e,g}, zero wherever spill > 0
    total_free = free.sum(0)  # [E] equals spill.sum(0)
    share = np.divide(free, total_free, out=np.zeros_like(free), where=total_free > 0)
    return n, sent, capacity, local, spill, share


def flexible_routing(counts: np.ndarray, source_ranks: Sequence[int], slots: np.ndarray) -> PairRouting:
    """Alg. 3. counts [S, E] tokens of each source per expert, source_ranks[s] the GPU of source s
    -> the tokens source s sends to expert e's vExperts on GPU g, for every GPU g holding e.

    Per GPU g and expert e: keep min(cap_e n_{e,g}, I_{e,g}) locally (line 5), send the rest to the
    other GPUs in proportion to their free capacity cap_e n_{e,g'} - (their own local use)
    (lines 6-10). A GPU's sources share its routing in proportion to their counts. Computed on
    the P (expert, holder) pairs only: O(S P), not O(S E G)."""
    counts = _check_counts(counts, len(source_ranks))
    slots = np.asarray(slots)
    source_ranks = np.asarray(source_ranks, dtype=np.int64)
    if source_ranks.size and (source_ranks.min() < 0 or source_ranks.max() >= slots.shape[0]):
        raise ValueError(f"source ranks must lie in [0, {slots.shape[0]})")
    n, sent, _, local, spill, share = _alg3(counts, source_ranks, slots)
    experts, ranks = np.nonzero(n.T)  # the pairs, ascending by (expert, GPU)
    own = ranks[None, :] == source_ranks[:, None]  # [S, P]: the pair is on the source's GPU
    # line 10: spill of the source's GPU x this GPU's share, plus the local part on the own GPU
    per_pair = spill[source_ranks][:, experts] * share[ranks, experts] \
        + np.where(own, local[source_ranks][:, experts], 0.0)  # [S, P]
    sent_by_gpu = sent[source_ranks]  # [S, E]
    fraction = np.divide(counts, sent_by_gpu, out=np.zeros_like(counts), where=sent_by_gpu > 0)
    return PairRouting(experts, ranks, per_pair * fraction[:, experts])


@dataclass(frozen=True)
class FlexCostModel:
    """Eq. 5 with Eq. 7-9, plus the adjustment cost of §3.4 (profiled constants, seconds)."""
    seconds_per_token: float  # 1 / TPS: forward + backward of one token by one expert (Eq. 7)
    seconds_per_token_sent: float = 0.0  # 1 / Bw: one token through one all-to-all between GPUs (Eq. 8)
    seconds_per_param_sent: float = 0.0  # 1 / Bw: one parameter element between GPUs (Eq. 9, Expand, Migrate)
    params_per_expert: int = 0  # size(e.gradients) in elements (Eq. 9)
    state_params_per_expert: int = 0  # size(e.model_states): params + optimizer states an Expand/Migrate moves
    amortize_steps: int = 1  # steps an adjustment's transfer cost is spread over

    def rank_times(self, counts: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """counts [G, E] -> Float[G]: sum over the experts on GPU g of T_C + T_A2A + T_Sync (Eq. 5).
        Alg. 3 fills every vExpert to cap_e (lines 7-10 spread the spill over the free capacity),
        so GPU g computes sum_e cap_e n_{e,g} tokens, of which it receives the part beyond its
        own local use."""
        slots = np.asarray(slots)
        counts = _check_counts(counts, slots.shape[0])
        n, _, capacity, local, _, _ = _alg3(counts, np.arange(slots.shape[0]), slots)
        computed = capacity.sum(1)  # [G]
        received = (capacity - local).sum(1)  # remote only
        held = n > 0  # [G, E]
        k = held.sum(0)  # [E] GPUs holding each expert
        sync = 2 * (k - 1) / k * self.params_per_expert * self.seconds_per_param_sent  # Eq. 9, ring
        return (computed * self.seconds_per_token  # Eq. 7
                + 4 * received * self.seconds_per_token_sent  # Eq. 8: 4 all-to-alls per step
                + held @ sync)

    def step_time(self, counts: np.ndarray, slots: np.ndarray) -> float:
        """T(I, P) of Eq. 5: the slowest GPU."""
        return float(self.rank_times(counts, slots).max())

    def adjust_time(self, ops: Sequence[Op]) -> float:
        """Transfer time of `ops`: model states of every Expand / Migrate between two GPUs (a
        Migrate's two directions run at once; same-GPU copies share weights; Shrink is a tag; an
        Expand that a Shrink cancels, `net_primitives`, moves nothing)."""
        moves = sum(1 for op in net_primitives(ops) if (isinstance(op, Expand) and op.src_rank != op.dst_rank)
                    or (isinstance(op, Migrate) and op.src_rank != op.dst_rank))
        return moves * self.state_params_per_expert * self.seconds_per_param_sent

    def predicted_time(self, counts: np.ndarray, slots: np.ndarray, ops: Sequence[Op]) -> float:
        """Step time after `ops` plus their transfer time spread over `amortize_steps`."""
        return self.step_time(counts, apply_ops(slots, ops)) + self.adjust_time(ops) / self.amortize_steps


class StepCosts:
    """Eq. 5 per GPU (`FlexCostModel.rank_times`, to rounding) of `counts` [G, E] (source GPU x expert) on `slots` [G, V], by expert column."""

    def __init__(self, cost: FlexCostModel, counts: np.ndarray, slots: np.ndarray):
        self.cost, self.counts = cost, counts
        self.tokens = counts.sum(0)  # [E] I_e
        self.n = vexpert_counts(slots, counts.shape[1])  # [G, E]
        self.columns = self._column(np.arange(counts.shape[1]), self.n)  # [G, E]
        self.times = self.columns.sum(1)  # [G]
        self.max_time = float(self.times.max())  # Eq. 5

    def _column(self, experts, n: np.ndarray) -> np.ndarray:
        """n [G, k] vExpert counts of `experts` -> [G, k] their part of each GPU's Eq. 5 time."""
        c = self.cost
        capacity = n * (self.tokens[experts] / n.sum(0))  # [G, k] tokens computed (Alg. 3 fills every vExpert to cap_e)
        received = np.maximum(capacity - self.counts[:, experts], 0.0)  # remote part
        held = n > 0
        k = held.sum(0)
        sync = (2 * c.params_per_expert * c.seconds_per_param_sent) * (k - 1) / k  # Eq. 9, ring
        return capacity * c.seconds_per_token + received * (4 * c.seconds_per_token_sent) + held * sync

    def times_after(self, delta: Dict[int, np.ndarray]) -> np.ndarray:
        """delta {expert: Int[G] change of n_{e,.}} -> Float[G] Eq. 5 per GPU after it."""
        experts = np.array(sorted(delta))
        n = self.n[:, experts] + np.stack([delta[e] for e in experts], 1)
        return self.times - self.columns[:, experts].sum(1) + self._column(experts, n).sum(1)


def _delta(ops: Sequence[Op], slots: np.ndarray, num_ranks: int) -> Dict[int, np.ndarray]:
    """The change of n_{e,g} that `ops` make, per expert they touch."""
    delta: Dict[int, np.ndarray] = {}

    def add(e: int, g: int, v: int) -> None:
        if e >= 0:
            delta.setdefault(e, np.zeros(num_ranks, dtype=np.int64))[g] += v

    for op in ops:
        if isinstance(op, Expand):
            add(op.expert, op.dst_rank, 1)
        elif isinstance(op, Shrink):
            add(op.expert, op.rank, -1)
        else:
            other = int(slots[op.dst_rank, op.dst_slot])
            add(op.expert, op.src_rank, -1)
            add(op.expert, op.dst_rank, 1)
            add(other, op.dst_rank, -1)
            add(other, op.src_rank, 1)
    return delta


def net_primitives(ops: Sequence[Op]) -> List[Op]:
    """`ops` without the Expand / Shrink pairs that cancel: an Expand and a Shrink of the same
    expert on the same GPU, in either order, leave n_{e,g} as it was and count as neither (nor
    is the Expand's transfer paid: the moves go from the first table to the last, §4). For
    counting and pricing; the result need not apply to a placement."""
    expands: Dict[Tuple[int, int], List[int]] = {}
    shrinks: Dict[Tuple[int, int], List[int]] = {}
    for i, op in enumerate(ops):
        if isinstance(op, Expand):
            expands.setdefault((op.expert, op.dst_rank), []).append(i)
        elif isinstance(op, Shrink):
            shrinks.setdefault((op.expert, op.rank), []).append(i)
    dropped = set()
    for key, grown in expands.items():
        pairs = min(len(grown), len(shrinks.get(key, [])))
        dropped.update(grown[:pairs] + shrinks.get(key, [])[:pairs])
    return [op for i, op in enumerate(ops) if i not in dropped]


def _rank(slots: np.ndarray, rank: int) -> int:
    if not 0 <= rank < slots.shape[0]:
        raise ValueError(f"rank {rank} is outside the {slots.shape[0]} GPUs of the placement")
    return rank


def _cell(slots: np.ndarray, rank: int, slot: int) -> Tuple[int, int]:
    if not 0 <= slot < slots.shape[1]:
        raise ValueError(f"slot {slot} is outside the {slots.shape[1]} slots per GPU of the placement")
    return _rank(slots, rank), slot


def apply_ops(slots: np.ndarray, ops: Sequence[Op]) -> np.ndarray:
    """Returns a new placement with `ops` applied in order (§3.3). Raises ValueError for an op the
    placement does not allow: Expand into a used slot or from a GPU without the expert, Shrink of
    an expert's last vExpert, an op naming a slot that does not hold its expert."""
    new = np.array(slots, copy=True)
    for op in ops:
        if isinstance(op, Expand):
            dst = _cell(new, op.dst_rank, op.dst_slot)
            if new[dst] != -1:
                raise ValueError(f"{op}: destination slot holds expert {new[dst]}")
            if op.expert not in new[_rank(new, op.src_rank)]:
                raise ValueError(f"{op}: source rank holds no vExpert of expert {op.expert}")
            new[dst] = op.expert
        elif isinstance(op, Shrink):
            cell = _cell(new, op.rank, op.slot)
            if new[cell] != op.expert:
                raise ValueError(f"{op}: slot holds expert {new[cell]}")
            if np.count_nonzero(new == op.expert) < 2:
                raise ValueError(f"{op}: expert {op.expert} would lose its last vExpert")
            new[cell] = -1
        else:
            src, dst = _cell(new, op.src_rank, op.src_slot), _cell(new, op.dst_rank, op.dst_slot)
            if new[src] != op.expert:
                raise ValueError(f"{op}: source slot holds expert {new[src]}")
            new[src], new[dst] = new[dst], op.expert
    return new


def _first_slot(row: np.ndarray, value: int) -> int:
    return int(np.flatnonzero(row == value)[0])


def make_scheduling_plan(counts: np.ndarray, slots: np.ndarray, cost: FlexCostModel) -> List[Op]:
    """Alg. 2. counts [G, E], slots [G, V] -> [Shrink(e1), Expand(e0)] (or [Expand(e0)] into a
    free slot), the cheapest by Eq. 5 + transfer cost, or [] when none beats the current t0.

    t0: Eq. 5 of the current placement (line 2). e0 / e1: the expert with the most / fewest
    tokens per vExpert (cap_e = I_e / n_e, lines 3-6), e1 among the others with >= 2 vExperts
    (a Shrink must leave a copy). t1: Eq. 5 after the plan plus its transfer cost (line 7), for
    every GPU that can take the new vExpert; the cheapest is returned if t1 < t0 (lines 8-9),
    else [] (line 10). Only e0 is ever expanded. Shrink comes first so its slot can take the
    Expand."""
    slots = np.asarray(slots)
    counts = _check_counts(counts, slots.shape[0])
    n = vexpert_counts(slots, counts.shape[1])  # [G, E]
    cap = counts.sum(0) / n.sum(0)  # line 5
    e0 = int(np.argmax(cap))
    shrinkable = (n.sum(0) >= 2) & (np.arange(cap.size) != e0)
    shrinks: List[Optional[Shrink]] = []
    if shrinkable.any():
        e1 = int(np.argmin(np.where(shrinkable, cap, np.inf)))
        shrinks = [Shrink(e1, g, _first_slot(slots[g], e1)) for g in np.flatnonzero(n[:, e1]).tolist()]
    best_time, best_plan = cost.step_time(counts, slots), []  # line 2: t0
    for shrink in shrinks + [None]:
        plan = [shrink] if shrink else []
        after = apply_ops(slots, plan)
        for g in np.flatnonzero((after == -1).any(1)).tolist():
            src = g if n[g, e0] else int(np.flatnonzero(n[:, e0])[0])  # same GPU: shared weights, free
            candidate = plan + [Expand(e0, src, g, _first_slot(after[g], -1))]
            t1 = cost.predicted_time(counts, slots, candidate)  # line 7
            if t1 < best_time:  # line 8
                best_time, best_plan = t1, candidate
    return best_plan


def propose_migration(counts: np.ndarray, slots: np.ndarray, cost: FlexCostModel) -> Optional[Migrate]:
    """Alg. 1 line 9: the Migrate with the lowest Eq. 5 + transfer cost that moves a vExpert of an
    expert held by several GPUs onto another GPU already holding it (exchanging it with a vExpert
    of another expert or a free slot there), or None when none beats the current step time."""
    slots = np.asarray(slots)
    steps = StepCosts(cost, _check_counts(counts, slots.shape[0]), slots)
    held = steps.n > 0  # [G, E]
    best_time, best = float(steps.times.max()), None
    for e in np.flatnonzero(held.sum(0) >= 2).tolist():
        for src in np.flatnonzero(held[:, e]).tolist():
            for dst in np.flatnonzero(held[:, e]).tolist():
                for other in np.unique(slots[dst]).tolist():
                    if dst == src or other == e:
                        continue
                    op = Migrate(e, src, _first_slot(slots[src], e), dst, _first_slot(slots[dst], other))
                    t1 = float(steps.times_after(_delta([op], slots, slots.shape[0])).max()) \
                        + cost.adjust_time([op]) / cost.amortize_steps
                    if t1 < best_time:
                        best_time, best = t1, op
    return best


Policy = Callable[[np.ndarray, np.ndarray, FlexCostModel], List[Op]]


def schedule(counts: np.ndarray, slots: np.ndarray, cost: FlexCostModel, threshold: float,
             policy: Policy = make_scheduling_plan, escape: Optional[Policy] = None) -> List[Op]:
    """Alg. 1 for one monitoring step: while Eq. 6 exceeds `threshold`, apply the policy maker's
    plans (Alg. 2 as printed, or `flexmoe_policy.straggler_plan`) until it returns none (lines
    2-8); then apply beneficial Migrates (line 9). Returns every op in order (apply with
    `apply_ops`). With `escape` (`flexmoe_policy.escape_plan`), a policy's {} at a placement this
    step's own plans reached is first handed to it, and its plan applied if it has one (a
    placement the step starts from was the previous step's end, where it was tried already).
    Terminates: each accepted plan strictly lowers the predicted GPU times (an escape: their max)."""
    ops: List[Op] = []
    current = np.asarray(slots)
    tokens = _check_counts(counts, current.shape[0]).sum(0)
    while balance_ratio(tokens, current) > threshold:
        plan = policy(counts, current, cost)
        if not plan and ops and escape is not None:
            plan = escape(counts, current, cost)
        if not plan:
            break
        ops += plan
        current = apply_ops(current, plan)
    migration = propose_migration(counts, current, cost)
    while migration is not None:
        ops.append(migration)
        current = apply_ops(current, [migration])
        migration = propose_migration(counts, current, cost)
    return ops
