"""FlexMoE's policy maker relative to the straggler (issue 30; `moe.flexmoe.policy: straggler`).

Nie et al., SIGMOD'23, §3.3-3.4 (shared/papers/002_9e9d849ca3726c8e.txt). Alg. 2 as printed
(`flexmoe_plan.make_scheduling_plan`, `moe.flexmoe.policy: printed`) only ever expands e0, the
expert with the most tokens per vExpert over all GPUs; once the slowest GPU holds no vExpert of
e0, no plan lowers Eq. 5, Alg. 2 returns {} and Alg. 1 stops with free slots left (a fixed point,
so planning more often does not help). §3.3 instead loops "until no beneficial modifications
exist", introduces Expand for stragglers and defines Migrate as a general exchange of model
states between two vExperts. This policy keeps Alg. 2's acceptance test and widens its
candidates:

    straggler s   the GPU with the largest Eq. 5 time
    e0 candidates the experts on s by cap_e = I_e / n_e, hottest first; then every other expert
                  by cap_e (the first e0 with a gaining plan wins, its cheapest plan is returned)
    plans per e0  Expand e0 into a free slot of GPU d; Shrink e1 (one of the idlest experts with
                  two or more vExperts) on a GPU holding it, then Expand e0 into the freed slot;
                  Migrate: exchange e0's vExpert on s with whatever GPU d's slot holds (another
                  expert's vExpert or a free slot)
    d             the `destinations` GPUs with the lowest Eq. 5 time (for an Expand: among those
                  with a free slot): the straggler's relief goes where there is room; trying
                  every GPU would cost O(G) more evaluations per candidate
    accepted if   t1 + (transfer cost) / amortize_steps < t0                      (Alg. 2 l. 7-8)

where t0 is the straggler's Eq. 5 time and t1 the largest Eq. 5 time, after the plan, among the
straggler and the GPUs whose time the plan changes. With one straggler well ahead this is Eq. 5's
max; while two GPUs tie for the maximum, Eq. 5's max could not drop by any one plan and the
printed test would stop, so each accepted plan lowers one of them and leaves no GPU above the old
maximum (the sorted GPU times drop lexicographically: Alg. 1 terminates). Expanding e0 on a GPU
that already holds it shares the weights there (§3.2): no transfer.

Plans are priced by `flexmoe_plan.StepCosts` (Eq. 5 re-evaluated on the expert columns a plan
changes, O(G) per plan).
"""
from __future__ import annotations

from typing import List

import numpy as np

from megatron_moe.techniques.flexmoe.flexmoe_plan import (Expand, FlexCostModel, Migrate, Op, Shrink, StepCosts,
                                                     _check_counts, _delta, _first_slot)

SHRINK_CANDIDATES = 4  # idlest replicated experts tried as e1 per e0
DESTINATIONS = 8  # least-loaded GPUs tried as the new vExpert's home per e0


def _evaluate(steps: StepCosts, slots: np.ndarray, straggler: int, ops: List[Op]) -> float:
    """t1 + amortised transfer of `ops` (module docstring), inf if a GPU ends above the old max."""
    after = steps.times_after(_delta(ops, slots, slots.shape[0]))
    if after.max() > steps.max_time * (1 + 1e-12):
        return np.inf
    changed = np.abs(after - steps.times) > 1e-12 * np.abs(steps.times)  # np.isclose(rtol=1e-12, atol=0), inverted
    changed[straggler] = True
    return float(after[changed].max()) + steps.cost.adjust_time(ops) / steps.cost.amortize_steps


def _plans_for(e0: int, steps: StepCosts, slots: np.ndarray, straggler: int, shrinkable: np.ndarray,
               destinations: np.ndarray, free_destinations: np.ndarray) -> List[List[Op]]:
    n = steps.n
    holders = np.flatnonzero(n[:, e0])
    plans: List[List[Op]] = []
    for d in free_destinations.tolist():
        src = d if n[d, e0] else int(holders[0])  # same GPU: shared weights, no transfer
        plans.append([Expand(e0, src, d, _first_slot(slots[d], -1))])
    if n[straggler, e0]:  # general Migrate: e0's vExpert on s <-> whatever d's slot holds
        for d in np.union1d(destinations, free_destinations).tolist():
            for other in np.unique(slots[d]).tolist():
                if other != e0:
                    plans.append([Migrate(e0, straggler, _first_slot(slots[straggler], e0), d,
                                          _first_slot(slots[d], other))])
        for d in destinations.tolist():
            plan = _evacuating_expand(e0, d, steps, slots, straggler)
            if plan:
                plans.append(plan)
    for e1 in shrinkable.tolist():
        if e1 == e0:
            continue
        for h in np.flatnonzero(n[:, e1]).tolist():
            if (h == straggler) != bool(n[straggler, e0] == 0):
                continue  # e0 on s: a new vExpert on s cannot relieve it; else only s's own e1 slot can
            src = h if n[h, e0] else int(holders[0])
            plans.append([Shrink(e1, h, _first_slot(slots[h], e1)), Expand(e0, src, h, _first_slot(slots[h], e1))])
    return plans


def _evacuating_expand(e0: int, d: int, steps: StepCosts, slots: np.ndarray, straggler: int) -> List[Op]:
    """Expand e0 onto GPU d after Migrating d's other vExperts (largest share first) into free
    slots of the least-loaded GPUs, until d's estimated Eq. 5 time fits under the straggler's; []
    when d need not (plain Expand) or cannot be cleared. A hot expert whose next vExpert is larger
    than any GPU's spare time can only grow this way; the plan is judged as a whole."""
    n, t0 = steps.n, steps.times[straggler]
    col = steps._column(np.array([e0]), n[:, [e0]] + np.eye(n.shape[0], dtype=np.int64)[:, [d]])[:, 0]
    need = steps.times[d] + col[d] - steps.columns[d, e0] - t0  # time d must shed
    if need <= 0 and (slots[d] == -1).any():
        return []
    work, times = slots.copy(), steps.times.copy()
    ops: List[Op] = []
    for x in sorted({int(x) for x in slots[d] if x >= 0 and x != e0}, key=lambda x: -steps.columns[d, x]):
        if need <= 0 and (work[d] == -1).any():
            break
        for _ in range(int(n[d, x])):
            room = np.flatnonzero((work == -1).any(1) & (n[:, x] == 0))
            room = room[(room != d) & (room != straggler)]
            if room.size == 0:
                return []
            r = int(room[np.argmin(times[room])])
            share = steps.columns[d, x] / n[d, x]
            if times[r] + share >= t0:
                return []
            ops.append(Migrate(x, d, _first_slot(work[d], x), r, _first_slot(work[r], -1)))
            work[d, ops[-1].src_slot], work[r, ops[-1].dst_slot] = -1, x
            times[r] += share
            need -= share
    if need > 0 or not (work[d] == -1).any():
        return []
    src = d if n[d, e0] else int(np.flatnonzero(n[:, e0])[0])
    return ops + [Expand(e0, src, d, _first_slot(work[d], -1))]


def straggler_plan(counts: np.ndarray, slots: np.ndarray, cost: FlexCostModel,
                   destinations: int = DESTINATIONS) -> List[Op]:
    """Alg. 2 relative to the straggler (module docstring): counts [G, E], slots [G, V] -> the
    ops of the first gaining plan ([Expand], [Shrink, Expand] or [Migrate]), or [] when none gains."""
    slots = np.asarray(slots)
    counts = _check_counts(counts, slots.shape[0])
    steps = StepCosts(cost, counts, slots)
    n_e = steps.n.sum(0)
    cap = steps.tokens / n_e  # Alg. 2 line 5
    straggler = int(np.argmax(steps.times))
    t0 = float(steps.times[straggler])
    replicated = np.flatnonzero(n_e >= 2)
    shrinkable = replicated[np.argsort(cap[replicated], kind="stable")][:SHRINK_CANDIDATES]
    by_time = np.argsort(steps.times, kind="stable")
    by_time = by_time[by_time != straggler]
    light = by_time[:destinations]
    light_free = by_time[(slots[by_time] == -1).any(1)][:destinations]
    on_straggler = np.flatnonzero(steps.n[straggler])
    order = np.argsort(-cap, kind="stable")
    candidates = list(on_straggler[np.argsort(-cap[on_straggler], kind="stable")])
    if np.intersect1d(shrinkable, on_straggler).size:  # others only relieve s by taking its e1's slot
        candidates += [e for e in order.tolist() if not steps.n[straggler, e]]
    for e0 in candidates:
        best_time, best = t0, []
        for plan in _plans_for(int(e0), steps, slots, straggler, shrinkable, light, light_free):
            t1 = _evaluate(steps, slots, straggler, plan)
            if t1 < best_time:
                best_time, best = t1, plan
        if best:
            return best
    return []



TRIGGERS = ("threshold", "interval")
POLICIES = ("straggler", "printed")


def check_flexmoe_config(cfg) -> None:
    """`moe.flexmoe.trigger` / `policy` / `amortize_steps` (called by this technique's section check)."""
    from megatron_moe.config.errors import ConfigError

    fm = cfg.moe.flexmoe
    if fm.trigger not in TRIGGERS:
        raise ConfigError(f"moe.flexmoe.trigger={fm.trigger!r} must be one of {', '.join(TRIGGERS)}")
    if fm.policy not in POLICIES:
        raise ConfigError(f"moe.flexmoe.policy={fm.policy!r} must be one of {', '.join(POLICIES)}")
    if fm.amortize_steps is not None and fm.amortize_steps < 1:
        raise ConfigError(f"moe.flexmoe.amortize_steps={fm.amortize_steps} must be >= 1 (or null)")


def amortize_steps(fm) -> int:
    """`moe.flexmoe.amortize_steps`, null = 100 with the threshold trigger (a placement lasts until
    the loads drift, FlexMoE §2.4: hundreds of iterations), `interval` with the interval trigger."""
    if fm.amortize_steps is not None:
        return fm.amortize_steps
    return 100 if fm.trigger == "threshold" else fm.interval
