"""Simulation results as JSON summaries, PNG plots and a ranking of option combinations.

`summarize(results)` (one option's `IterationResult`s) ->
    {"iteration_ms": {"mean", "p50", "min", "max"},
     "moe_layer_ms": [mean per MoE layer], "balance_ratio": [...], "balance_degree": [...],
     "replicas": [...], "schedules": [{executed schedule: count}], "plan_ms": [...],
     "vexpert_moves": primitives over the run (EPLB: one per changed slot), "vexpert_transfers":
     the rank-to-rank expert transfers they took (a Shrink none, a Migrate one or two),
     "breakdown_ms": {op: {"exposed", "hidden"}}       # mean per iteration, over labels
     "compute_ms", "communication_exposed_ms", "communication_hidden_ms", "overlap_ms",
     "pipeline_idle_ms", "pipeline_bubble", "pipeline_bubble_ideal",   # 0 with one pipeline stage
     "bytes_per_iteration": {kind: bytes summed over ranks}}

`candidate_options(tensor)` is what `--recommend` ranks: every schedule (baseline, s1, s2, s2 + SAA,
auto, auto + SAA) x balancer (none, fastermoe, proprophet, proprophet with its block-wise
scheduler, flexmoe, eplb) x FasterMoE's smart schedule (off, on; not with SAA) x Lancet's dW
scheduling (off, on), as config overrides; combinations the config rules refuse are skipped.
With parallel.tensor=1 only the baseline schedule is ranked: Parm's S1, S2 and auto place the
MP collectives, and with no MP they run the baseline's communication (120 combinations -> 24).
"""
from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass, field
from typing import Dict, List

import numpy as np


@dataclass
class LayerResult:
    seconds: float  # exposed time of the layer's ops on the critical rank, summed over micro-batches
    breakdown: Dict[str, List[float]]  # op -> [exposed, duration] seconds, communication (1) or not (0)
    rows_per_group: np.ndarray  # [ep_esp groups, ep] rows computed per EP rank, summed over micro-batches
    replicas: float  # mean replicas per forward and group
    schedules: Dict[str, int] = field(default_factory=dict)  # executed schedule -> (group, micro-batch) count
    plan_seconds: float = 0.0  # wall time the real planners took here (measured, not modelled)

    @property
    def rows_per_ep_rank(self) -> np.ndarray:
        """[ep] rows computed per EP rank, summed over the ep_esp groups (benchmarks/moe_layer.py's)."""
        return self.rows_per_group.sum(0)

    @property
    def balance_ratio(self) -> float:
        load = self.rows_per_ep_rank
        return float(load.max() / load.mean()) if load.mean() > 0 else 1.0

    @property
    def balance_degree(self) -> float:
        """Pro-Prophet's balance degree: the standard deviation of the rows per device."""
        return float(np.std(self.rows_per_ep_rank))


@dataclass
class IterationResult:
    iteration: int
    seconds: float
    # "<label>/<op>" -> [exposed, duration, kind: communication 1, computation 0, overlap 2, idle 3] on
    # the critical rank (with pipeline stages: of the stage that finishes last; "pipeline/idle" its bubble)
    breakdown: Dict[str, List[float]]
    layers: List[LayerResult]
    bytes_by_kind: Dict[str, float]  # summed over ranks
    vexpert_moves: int = 0  # primitives decided after the step (Expand / Shrink / Migrate; EPLB: changed slots)
    vexpert_transfers: int = 0  # rank-to-rank expert transfers they take (`vexpert_moves.plan_transfers`), per ep group
    pipeline_bubble: float = 0.0  # the trainer's metric: per stage 1 - compute / the slowest stage's program
    pipeline_bubble_ideal: float = 0.0  # (p - 1) / (v m + p - 1)


SCHEDULES = [["moe.schedule=baseline"], ["moe.schedule=s1"], ["moe.schedule=s2"], ["moe.schedule=s2", "moe.saa=true"],
             ["moe.schedule=auto"], ["moe.schedule=auto", "moe.saa=true"]]
BALANCERS = [["moe.balancer=none"], ["moe.balancer=fastermoe"], ["moe.balancer=proprophet"],
             ["moe.balancer=proprophet", "moe.proprophet.overlap=true"], ["moe.balancer=flexmoe"], ["moe.balancer=eplb"]]


def candidate_options(tensor: int) -> List[List[str]]:
    schedules = SCHEDULES if tensor > 1 else SCHEDULES[:1]
    out = []
    for schedule, balancer, smart, dw in itertools.product(schedules, BALANCERS, (False, True), (False, True)):
        if smart and "moe.saa=true" in schedule:
            continue
        out.append(schedule + balancer + [f"moe.smart_schedule={str(smart).lower()}",
                                          f"moe.lancet.defer_wgrad={str(dw).lower()}"])
    return out


def _mean(values) -> float:
    return float(np.mean(values)) if len(values) else 0.0


def summarize(results) -> Dict:
    ms = np.array([r.seconds for r in results]) * 1e3
    layers = len(results[0].layers) if results else 0
    ops: Dict[str, List[float]] = {}
    compute = comm_exposed = comm_hidden = overlap = idle = 0.0
    for r in results:
        for key, (exposed, duration, kind) in r.breakdown.items():
            name = key.split("/", 1)[1]
            entry = ops.setdefault(name, [0.0, 0.0])
            entry[0] += exposed
            entry[1] += max(duration - exposed, 0.0)
            if kind == 1.0:
                comm_exposed += exposed
                comm_hidden += max(duration - exposed, 0.0)
            elif kind == 2.0:
                overlap += exposed
            elif kind == 3.0:
                idle += exposed
            else:
                compute += exposed
    n = max(len(results), 1)
    bytes_ = {}
    for r in results:
        for kind, value in r.bytes_by_kind.items():
            bytes_[kind] = bytes_.get(kind, 0.0) + value / n
    schedules = []
    for i in range(layers):
        merged: Dict[str, int] = {}
        for r in results:
            for name, count in r.layers[i].schedules.items():
                merged[name] = merged.get(name, 0) + count
        schedules.append(merged)
    return {
        "iterations": len(results),
        "iteration_ms": {"mean": _mean(ms), "p50": float(np.median(ms)) if len(ms) else 0.0,
                         "min": float(ms.min()) if len(ms) else 0.0, "max": float(ms.max()) if len(ms) else 0.0},
        "moe_layer_ms": [_mean([r.layers[i].seconds * 1e3 for r in results]) for i in range(layers)],
        "balance_ratio": [_mean([r.layers[i].balance_ratio for r in results]) for i in range(layers)],
        "balance_degree": [_mean([r.layers[i].balance_degree for r in results]) for i in range(layers)],
        "replicas": [_mean([r.layers[i].replicas for r in results]) for i in range(layers)],
        "plan_ms": [_mean([r.layers[i].plan_seconds * 1e3 for r in results]) for i in range(layers)],
        "schedules": schedules,
        "vexpert_moves": int(sum(r.vexpert_moves for r in results)),  # primitives
        "vexpert_transfers": int(sum(r.vexpert_transfers for r in results)),  # rank-to-rank moves, per ep group
        "breakdown_ms": {name: {"exposed": e / n * 1e3, "hidden": h / n * 1e3} for name, (e, h) in sorted(ops.items())},
        "compute_ms": compute / n * 1e3,
        "communication_exposed_ms": comm_exposed / n * 1e3,
        "communication_hidden_ms": comm_hidden / n * 1e3,
        "overlap_ms": overlap / n * 1e3,  # Lancet's dW running inside backward all-to-alls
        "pipeline_idle_ms": idle / n * 1e3,  # the critical stage waiting for the others (its bubble)
        "pipeline_bubble": _mean([r.pipeline_bubble for r in results]),
        "pipeline_bubble_ideal": _mean([r.pipeline_bubble_ideal for r in results]),
        "bytes_per_iteration": {k: float(v) for k, v in sorted(bytes_.items())},
    }


def write_json(path: str, payload: Dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)


def plot(runs: Dict[str, list], directory: str) -> List[str]:
    """PNGs comparing the options side by side: iteration time over the trace, the mean exposed
    breakdown per option, and each option's balance ratio per MoE layer. Returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, results in runs.items():
        ax.plot([r.iteration for r in results], [r.seconds * 1e3 for r in results], label=name)
    ax.set_xlabel("iteration")
    ax.set_ylabel("predicted iteration time (ms)")
    ax.legend(fontsize=6)
    paths.append(_save(fig, directory, "iteration_time.png"))

    summaries = {name: summarize(results) for name, results in runs.items()}
    ops = sorted({op for s in summaries.values() for op in s["breakdown_ms"]})
    fig, ax = plt.subplots(figsize=(9, 4 + 0.2 * len(runs)))
    bottom = np.zeros(len(runs))
    for op in ops:
        values = np.array([s["breakdown_ms"].get(op, {"exposed": 0.0})["exposed"] for s in summaries.values()])
        if values.any():
            ax.barh(list(runs), values, left=bottom, label=op)
            bottom += values
    ax.set_xlabel("exposed time per iteration (ms), critical rank")
    ax.legend(fontsize=6, ncol=1, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    paths.append(_save(fig, directory, "breakdown.png"))

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, s in summaries.items():
        ax.plot(range(len(s["balance_ratio"])), s["balance_ratio"], marker="o", label=name)
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("balance ratio (max / mean rows per EP rank)")
    ax.legend(fontsize=6)
    paths.append(_save(fig, directory, "balance_ratio.png"))
    return paths


def _save(fig, directory: str, name: str) -> str:
    path = os.path.join(directory, name)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
