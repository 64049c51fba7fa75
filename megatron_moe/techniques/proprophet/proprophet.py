"""Pro-Prophet's planner (Wang et al., §II-B locality, §IV-A lightweight placements, §IV-C Alg. 1;
`moe.balancer: proprophet`).

A *lightweight placement* maps each expert to a subset of EP ranks ("devices"); a device that
holds a replica of expert e computes its own sources' rows of e locally (the owner's weights come
by *Trans*, the gradients go back by *Agg*, `moe/replicas.py`). `moe.proprophet.rows: local`
(default) is the paper's (§IV-A, Fig. 6b): every device with a replica computes exactly its own
sources' rows of e ("its local inputs routed to these experts could be computed locally"), the
owner the rows of the devices without one. `rows: balanced` is ours: the rows of e are split among
e's devices so that their loads level out (integer water-filling, lowest load first), and each
device fills its share with its own sources' rows before it receives any, so rows travel only
where the balance needs them. (The functions below take `rows`; their default, balanced, is what
`benchmarks/proprophet_planner.py` and the plan-quality figures measure; the balancer passes the
configured one.) The greedy search of Alg. 1, per layer, on T [D, E] (rows each device's sources
route to each expert):

    H, R = owner-only loads;  T_out = T'(R, H, 0)                       lines 1-4 (Eq. 6 / Eq. 8)
    while not balanced (Eq. 7: max H - min H < alpha I / E):            line 5
        i = argmax H;  e = an expert of i not selected yet               lines 6-10 (stop if none)
        devices of e = its owner + every device with rows of e, except
                       the n (`bottom_k`) with the fewest                lines 11-13
        H, R = Replace_Inputs(...)                                       line 15
        if T'(R, H, s) < T_out: T_out, cnt = T'(...), s                  lines 16-20
    plan = the first cnt selections                                      line 22

The paper has one expert per device, so "device i" and "expert i" coincide; with several experts
per EP rank we take, of the heaviest device's experts not selected yet, the one whose move predicts
the lowest T' (ties: the heavier), and stop (lines 7-8's `break`) when that device has none left.
(Taking its heaviest expert instead ignores locality: on 120 small random cases it was 1.12 x the
optimum at worst, this 1.08; `tests/unit/test_proprophet.py`.) The cost model is
`techniques/proprophet/proprophet_model.py`.

Locality (§II-B, Fig. 4; §IV-C): the plan for the next forwards is searched on this forward's distribution
(`observe`, the `Plan` primitive), every `moe.proprophet.plan_interval` iterations, and reused in
between; `plan` applies the plan in force to the current counts (so the routing table is always
exact) and searches on the current counts only when there is no plan yet (the first forward).
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from megatron_moe.moe.balancers import BALANCERS
from megatron_moe.moe.balancers.base import REPLICA_AGG, Balancer
from megatron_moe.techniques.fastermoe.fastermoe import rows_per_rank
from megatron_moe.moe.placement import Placement, owner_table
from megatron_moe.perf import timing
from megatron_moe.perf.hardware import configured_profile, expert_shape
from megatron_moe.techniques.proprophet import cross_layer
from megatron_moe.techniques.proprophet.proprophet_model import PROPROPHET_OPS, ProphetCostModel
from megatron_moe.config.errors import ConfigError
from megatron_moe.config.validate import expert_proj_bias, section_check
from megatron_moe.perf.hardware import PROFILE_NEEDS
from megatron_moe.distributed.parallel_state import SIDE_CHANNELS
from megatron_moe.model.transformer import moe_layer_spacing

Selection = Tuple[int, Tuple[int, ...]]  # (expert, its devices: owner first, then ascending)


def water_fill(levels, amount: int) -> np.ndarray:
    """Integer rows to add to each of `levels` [k] so that the lowest rise together: the result sums
    to `amount` and min(levels + result) is as high as it can be; a remainder that cannot be split
    evenly goes one row each to the lowest original levels (then the earlier index)."""
    levels = np.asarray(levels, dtype=np.int64)  # (array methods, not np.* functions: this is hot)
    order = levels.argsort(kind="stable")  # lowest first, then the earlier index
    ascending = levels[order]
    # rows needed to raise the j + 1 lowest to the level of the (j+1)-th lowest: non-decreasing in j
    needed = ascending * np.arange(1, len(levels) + 1) - ascending.cumsum()
    k = int(needed.searchsorted(amount, side="right"))  # how many rise (>= 1: needed[0] = 0)
    step, extra = divmod(int(amount - needed[k - 1]), k)
    give = np.zeros(len(levels), dtype=np.int64)
    give[order[:k]] = ascending[k - 1] + step - ascending[:k]
    give[order[:extra]] += 1
    return give


class Loads:
    """Rows computed (H) and received from other devices (R) per device under a lightweight
    placement built one expert at a time (Alg. 1's Replace_Inputs)."""

    def __init__(self, T: np.ndarray, rows: str = "balanced"):
        self.T, self.local_rows = T, rows == "local"  # [D, E]; `moe.proprophet.rows`
        D, E = T.shape
        self.owners = np.arange(E) // (E // D)
        self.by_expert = np.ascontiguousarray(T.T)  # [E, D]: what each device routes to e
        self.total = T.sum(0)  # [E]
        self.on_device = np.zeros((E, D), dtype=np.int64)  # rows of e computed on d
        self.on_device[np.arange(E), self.owners] = self.total
        self.received = self.on_device.copy()  # [E, D], of which from other devices
        self.received[np.arange(E), self.owners] -= self.by_expert[np.arange(E), self.owners]
        self.H, self.R = self.on_device.sum(0), self.received.sum(0)

    @property
    def computed(self) -> np.ndarray:
        """[D, E] rows of e computed on device d."""
        return self.on_device.T

    def moved(self, e: int, devices: np.ndarray) -> "Move":
        """Expert e computed on `devices` (Int[k], owner first). Local rows (the paper's, §IV-A,
        Fig. 6b): each device computes its own sources' rows of e, the owner the rest (the rows of
        devices without a replica). Balanced rows: its rows are water-filled over them (each
        device's share levels the loads), and each device takes its share from its own sources'
        rows first."""
        if self.local_rows:
            share = self.by_expert[e][devices].copy()
            share[0] = self.total[e] - share[1:].sum()
        else:
            share = water_fill(self.H[devices] - self.on_device[e][devices], int(self.total[e]))
        received = share - np.minimum(self.by_expert[e][devices], share)
        H, R = self.H - self.on_device[e], self.R - self.received[e]
        H[devices] += share
        R[devices] += received
        return Move(e, devices, share, received, H, R)

    def apply(self, move: "Move") -> None:
        """Replace_Inputs: make `move` (from `moved` on the current loads) the loads."""
        self.on_device[move.expert] = 0
        self.received[move.expert] = 0
        self.on_device[move.expert, move.devices] = move.share
        self.received[move.expert, move.devices] = move.received
        self.H, self.R = move.H, move.R

    def replicate(self, e: int, devices: Tuple[int, ...]) -> Tuple[np.ndarray, np.ndarray]:
        """`apply(moved(...))`. Returns, for each of `devices`, (rows of e it keeps from its own
        sources, rows it receives)."""
        move = self.moved(e, np.asarray(devices))
        self.apply(move)
        return move.share - move.received, move.received


@dataclass(frozen=True)
class Move:
    """Expert `expert` on `devices` [k]: rows each computes (`share`), of which received from
    other devices; H, R [D]: every device's loads after the move."""

    expert: int
    devices: np.ndarray
    share: np.ndarray
    received: np.ndarray
    H: np.ndarray
    R: np.ndarray


def devices_for(T: np.ndarray, e: int, owner: int, bottom_k: int) -> Tuple[int, ...]:
    """Alg. 1 line 11: expert e goes to every device with rows of it except the `bottom_k` with the
    fewest (ties: the higher rank is dropped first); its owner always keeps it."""
    return tuple(_devices(np.ascontiguousarray(T[:, e]), owner, bottom_k).tolist())


def _devices(rows: np.ndarray, owner: int, bottom_k: int) -> np.ndarray:
    """`devices_for` of one expert's rows per device [D] -> Int[k], owner first, then ascending."""
    others = rows.nonzero()[0]
    others = others[others != owner]  # ascending
    if bottom_k:
        others = np.sort(others[np.lexsort((-others, rows[others]))][bottom_k:])
    return np.concatenate(([owner], others))


def greedy_search(T: np.ndarray, model: ProphetCostModel, alpha: float, bottom_k: int = 0,
                  rows: str = "balanced") -> List[Selection]:
    """Alg. 1 on T [D, E] -> the selections of the best placement found, in the order they apply."""
    D, E = T.shape
    loads = Loads(T, rows)
    best, count, transfers = model.layer(loads.H, loads.R, 0), 0, 0
    chosen: List[Selection] = []
    selected = np.zeros(E, dtype=bool)
    per_rank = E // D
    threshold = alpha * float(T.sum()) / E
    while D > 1:
        i = int(loads.H.argmax())
        if float(loads.H[i] - loads.H.min()) < threshold:  # Eq. 7: balanced
            break
        left = [e for e in range(i * per_rank, (i + 1) * per_rank) if not selected[e]]
        if not left:  # lines 7-8: the heaviest device has nothing left to give
            break
        left.sort(key=lambda e: -loads.on_device[e, i])  # heaviest first (stable)
        best_move, best_t = None, None  # the move with the lowest T' (ties: the heavier expert)
        for e in left:
            devices = _devices(loads.by_expert[e], i, bottom_k)
            if len(devices) == 1:  # nobody else routes to e: nothing to move
                selected[e] = True
                continue
            move = loads.moved(e, devices)
            t = model.layer(move.H, move.R, transfers + len(devices) - 1)
            if best_t is None or t < best_t:
                best_move, best_t = move, t
        if best_move is None:
            continue
        selected[best_move.expert] = True
        loads.apply(best_move)
        chosen.append((best_move.expert, tuple(best_move.devices.tolist())))
        transfers += len(best_move.devices) - 1
        if best_t < best:
            best, count = best_t, len(chosen)
    return chosen[:count]


def predicted_time(T: np.ndarray, model: ProphetCostModel, chosen: Sequence[Selection],
                   rows: str = "balanced") -> float:
    """T' (Eq. 6 / Eq. 8) of the placement `chosen` on T [D, E]."""
    loads = Loads(T, rows)
    for e, devices in chosen:
        loads.replicate(e, devices)
    return model.layer(loads.H, loads.R, sum(len(devices) - 1 for _, devices in chosen))


def exhaustive_search(T: np.ndarray, model: ProphetCostModel, rows: str = "balanced") -> Tuple[float, List[Selection]]:
    """The reference Alg. 1 is measured against (tests, `benchmarks/proprophet_planner.py`): every
    lightweight placement, each expert on its owner plus any subset of the devices with rows of it
    (applied in expert order) -> (lowest T', its selections). Exponential: E <= 6, D <= 3."""
    D, E = T.shape
    owners = np.arange(E) // (E // D)
    options = []
    for e in range(E):
        others = [d for d in range(D) if d != owners[e] and T[d, e] > 0]
        options.append([(int(owners[e]),) + sub for r in range(len(others) + 1)
                        for sub in itertools.combinations(others, r)])
    best: Tuple[float, List[Selection]] = (float("inf"), [])
    for combo in itertools.product(*options):
        chosen = [(e, devices) for e, devices in enumerate(combo) if len(devices) > 1]
        best = min(best, (predicted_time(T, model, chosen, rows), chosen), key=lambda pair: pair[0])
    return best


def ratios_to_optimum(cases: int, seed: int = 0, skew: float = 1.2, rows: str = "balanced") -> List[float]:
    """Alg. 1's T' over `exhaustive_search`'s on `cases` random small cases (D in {2, 3}, E / D in
    {1, 2}, Zipf(`skew`) popularity, exponential per-device volumes, replica costs 4 to 80
    elements), both with `rows`: the plan-quality figure of the tests and
    `benchmarks/proprophet_planner.py`."""
    rng = random.Random(seed)
    ratios = []
    for _ in range(cases):
        D = rng.choice([2, 3])
        E = D * rng.choice([1, 2])
        popularity = [1.0 / (k + 1) ** skew for k in range(E)]
        rng.shuffle(popularity)
        T = np.array([[int(rng.expovariate(1.0) * 20 * p) for p in popularity] for _ in range(D)], dtype=np.int64)
        model = ProphetCostModel(row_elements=4, params_per_expert=rng.choice([4.0, 20.0, 80.0]),
                                 seconds_per_row=1.0, seconds_per_element=0.05, fnec_seconds=0.0)
        chosen = greedy_search(T, model, alpha=0.0, rows=rows)
        if predicted_time(T, model, chosen, rows) > predicted_time(T, model, [], rows) + 1e-9:
            raise AssertionError(f"Alg. 1 planned worse than no placement on {T.tolist()}")
        ratios.append(predicted_time(T, model, chosen, rows) / exhaustive_search(T, model, rows)[0])
    return ratios


def lightweight_placement(counts: torch.Tensor, source_ep_ranks: Sequence[int], ep_size: int,
                          chosen: Sequence[Selection], rows: str = "balanced") -> Placement:
    """The Placement of `chosen` for counts Long[S, E]: selections applied in order, as the search
    evaluated them (`Loads.replicate`); the rows a device keeps come from its own sources in source
    order, every other row fills the devices' remaining shares in source order, devices in order."""
    if not chosen:
        return Placement.owner_only(counts, ep_size)
    replicas, table = owner_table(counts, ep_size)
    replicas = list(replicas)
    table = table.numpy()  # [S, E, ep], a view: filled in place
    rows_of = counts.numpy()
    sources = np.asarray(source_ep_ranks)
    loads = Loads(rows_per_rank(counts, source_ep_ranks, ep_size).numpy(), rows)
    by_device = np.argsort(sources, kind="stable")  # sources grouped by device, in source order
    for e, devices in chosen:
        keep, receive = loads.replicate(e, devices)
        replicas[e] = devices
        table[:, e] = 0
        rows = rows_of[:, e]
        # kept: each device's sources, in order, until its keep is used up
        allowance = np.zeros(ep_size, dtype=np.int64)
        allowance[list(devices)] = keep
        grouped = rows[by_device]
        before = np.cumsum(grouped) - grouped  # rows of earlier sources of the same device
        group_start = np.searchsorted(sources[by_device], sources[by_device])
        before -= before[group_start]
        kept = np.empty_like(rows)
        kept[by_device] = np.clip(allowance[sources[by_device]] - before, 0, grouped)
        table[np.arange(len(rows)), e, sources] += kept
        # the rest, in source order, fills the devices' remaining shares, in device order: the
        # overlap of the sources' intervals with the shares' on one line of rows
        rest = rows - kept
        rest_end = np.cumsum(rest)
        quota_end = np.cumsum(receive)
        overlap = (np.minimum(rest_end[:, None], quota_end[None, :])
                   - np.maximum((rest_end - rest)[:, None], (quota_end - receive)[None, :]))
        table[:, e, list(devices)] += np.maximum(overlap, 0)
    return Placement(tuple(replicas), torch.from_numpy(table))


ROWS = ("local", "balanced")  # moe.proprophet.rows: the paper's (§IV-A, Fig. 6b, the default), ours


def check_proprophet_config(cfg) -> None:
    """`moe.proprophet.rows` (called by this technique's section check)."""
    from megatron_moe.config.errors import ConfigError

    if cfg.moe.proprophet.rows not in ROWS:
        raise ConfigError(f"moe.proprophet.rows={cfg.moe.proprophet.rows!r} must be one of {', '.join(ROWS)}")


@BALANCERS.register("proprophet")
class ProProphet(Balancer):
    """Alg. 1 with locality: the plan searched on one forward's distribution serves the next ones."""

    cross_layer = cross_layer  # Alg. 2's block-wise scheduler (active with moe.proprophet.overlap)
    late_expert_grads = REPLICA_AGG

    def __init__(self, cfg, state):
        super().__init__(cfg, state)
        m, pp = cfg.model, cfg.moe.proprophet
        self.plans_during_dispatch = self.prefetches_trans = pp.overlap  # Alg. 2
        shape = expert_shape(cfg, state)
        fnec_flops = non_moe_flops_per_token(cfg, state) * cfg.training.micro_batch_size * m.seq_length
        profile = configured_profile(cfg, PROPROPHET_OPS, "moe.balancer=proprophet")
        self.model = ProphetCostModel.from_profile(profile, m.hidden_size, shape.params(expert_proj_bias(cfg), state.esp_size),
                                                   shape.flops_per_row, fnec_flops, pp.overlap)
        self.alpha, self.bottom_k, self.min_replicas, self.rows = pp.alpha, pp.bottom_k, pp.min_replicas, pp.rows
        micro_batches = max(1, cfg.training.global_batch_size // (cfg.training.micro_batch_size * state.dp_size))
        self.plan_every = pp.plan_interval * micro_batches  # forwards between searches
        self.chosen: Optional[List[Selection]] = None  # the plan in force
        self.forwards = 0

    def search(self, counts: torch.Tensor, source_ep_ranks: List[int]) -> List[Selection]:
        T = rows_per_rank(counts, source_ep_ranks, self.ep_size).numpy()
        chosen = greedy_search(T, self.model, self.alpha, self.bottom_k, self.rows)
        if len(chosen) < self.min_replicas:  # experiments and tests: force Trans / Agg
            forced = [(e, devices_for(T, e, int(e // (self.num_experts // self.ep_size)), self.bottom_k))
                      for e in np.argsort(-T.sum(0), kind="stable").tolist() if e not in dict(chosen)]
            chosen = chosen + [sel for sel in forced if len(sel[1]) > 1][: self.min_replicas - len(chosen)]
        return chosen

    def plan(self, counts: torch.Tensor, source_ep_ranks: List[int]) -> Placement:
        chosen = self.chosen if self.chosen is not None else self.search(counts, source_ep_ranks)
        return lightweight_placement(counts, source_ep_ranks, self.ep_size, chosen, self.rows)

    def observe(self, counts: torch.Tensor, source_ep_ranks: List[int]) -> None:
        """`Plan` (§IV-C): every `plan_every` training forwards, search on this forward's counts for
        the forwards after it; `last_plan_seconds` is the search time (0 when none ran)."""
        self.last_plan_seconds = 0.0
        if self.forwards % self.plan_every == 0:
            with timing.wall() as searched:  # host work: numpy on the CPU counts
                self.chosen = self.search(counts, source_ep_ranks)
            self.last_plan_seconds = searched.seconds
        self.forwards += 1

    def upcoming_replicas(self) -> Optional[List[Selection]]:
        """The replicas the next forward will use (None until a plan exists): the block-wise
        scheduler prefetches their *Trans* (`techniques/proprophet/cross_layer.py`)."""
        return self.chosen


def non_moe_flops_per_token(cfg, state) -> float:
    """Forward FLOPs per token of one block's non-MoE part on one rank (attention projections and
    scores, and the dense FFNs of the layers between two MoE layers, `moe_layer_spacing` - 1: layer_freq - 1
    or, with first_k_dense / layer_pattern, the fewest), for T_FNEC (§V-C, Eq. 8; static, §V-B)."""
    m, spacing = cfg.model, moe_layer_spacing(cfg)
    h, s, tp = m.hidden_size, m.seq_length, state.tp_size
    attention = 2 * 4 * h * h / tp + 2 * 2 * s * h / tp
    dense = 2 * 2 * h * m.ffn_hidden_size / tp * (spacing - 1)
    return attention * spacing + dense


@section_check("moe.proprophet")
def _check_proprophet(cfg, world_size: int) -> None:
    moe, pp = cfg.moe, cfg.moe.proprophet
    if moe.balancer == "proprophet":
        check_proprophet_config(cfg)
    for key, value, ok, rule in [("alpha", pp.alpha, pp.alpha >= 0, ">= 0"),
                                 ("plan_interval", pp.plan_interval, pp.plan_interval >= 1, ">= 1"),
                                 ("bottom_k", pp.bottom_k, pp.bottom_k >= 0, ">= 0"),
                                 ("min_replicas", pp.min_replicas, 0 <= pp.min_replicas <= moe.num_experts,
                                  "in [0, moe.num_experts]")]:
        if not ok:
            raise ConfigError(f"moe.proprophet.{key}={value} must be {rule}")


@SIDE_CHANNELS.register("proprophet")
def _side_channels(cfg) -> list:
    """Trans / Agg (moe/replicas.py), with the block-wise scheduler or without, travel on a side
    channel of ``ep``: in flight while the all-to-alls run, they never queue ahead of them on NCCL
    (SubTrans during block i's FEC / FNEC, SubAgg during its backward: Alg. 2 lines 7, 9, 12-15)."""
    return ["ep"] if cfg.moe.balancer == "proprophet" else []


@PROFILE_NEEDS.register("proprophet")
def _profile_needs(cfg) -> list:
    return [(PROPROPHET_OPS, "moe.balancer=proprophet")] if cfg.moe.balancer == "proprophet" else []
