"""`report SWEEP_DIR`: one row per run from its metrics.jsonl, seeds aggregated per point.

A metric is a metrics.jsonl field (docs/running.md): a number as it is; a dict field
(`a2a_exposed_ms` = {forward, backward}) the sum of its values, or one value by a dotted name
(`a2a_exposed_ms.forward`); a per-MoE-layer list (`expert_load_imbalance`) the mean over layers,
or one layer (`expert_load_imbalance.0`). A run's value is the last record's (`report.value: final`)
or the mean over its records of the last `report.last_n` iterations (`mean`); a metric logged
only now and then (`eval_ppl`) takes the records that have it. The seeds of a point aggregate as
mean and sample standard deviation (n - 1; none for one seed).

Writes results.csv (per run, the exact values), results_points.csv (per point: mean, std, n) and
results.md (per point, mean ± std), then the plots and TensorBoard HParams (plots.py).
"""
from __future__ import annotations

import csv
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from megatron_moe.sweep.spec import SEED_KEY, format_value
from megatron_moe.sweep.state import read_records, run_status


def metric_value(record: Dict, metric: str) -> Optional[float]:
    """One record's number for `metric` (see the module docstring), None if it has none."""
    value: Any = record
    for part in metric.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    if isinstance(value, dict):
        value = sum(v for v in value.values() if isinstance(v, (int, float))) if value else None
    elif isinstance(value, list):
        numbers = [v for v in value if isinstance(v, (int, float))]
        value = sum(numbers) / len(numbers) if numbers else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def reduce_metric(records: Sequence[Dict], metric: str, value: str, last_n: int) -> Optional[float]:
    """`final`: the last record that has the metric; `mean`: mean over those of the last `last_n`
    iterations (the last record's iteration - last_n < iteration), or the final value if none is there."""
    pairs = [(r["iteration"], v) for r in records if (v := metric_value(r, metric)) is not None]
    if not pairs:
        return None
    if value == "final":
        return pairs[-1][1]
    end = records[-1]["iteration"]
    window = [v for it, v in pairs if it > end - last_n]
    return sum(window) / len(window) if window else pairs[-1][1]


@dataclass
class RunRow:
    index: int
    name: str
    point: str
    varied: Dict[str, Any]
    state: str
    iteration: int
    train_iters: int
    values: Dict[str, Optional[float]]
    records: List[Dict] = field(repr=False, default_factory=list)


def collect(plan: Dict, metrics: Sequence[str], value: str, last_n: int) -> List[RunRow]:
    rows = []
    for r in plan["runs"]:
        records = read_records(r["run_dir"])
        status = run_status(r["run_dir"], r["train_iters"])
        rows.append(RunRow(r["index"], r["name"], r["point"], {k: v for k, v in r["varied"]}, status.state,
                           records[-1]["iteration"] if records else 0, r["train_iters"],
                           {m: reduce_metric(records, m, value, last_n) for m in metrics}, records))
    return rows


@dataclass
class PointRow:
    point: str
    varied: Dict[str, Any]  # without the seed
    runs: List[RunRow]
    mean: Dict[str, Optional[float]]
    std: Dict[str, Optional[float]]
    n: Dict[str, int]


def aggregate(rows: Sequence[RunRow], metrics: Sequence[str]) -> List[PointRow]:
    """Per point, in sweep order: mean and sample std over its seeds' values."""
    points: Dict[str, List[RunRow]] = {}
    for row in rows:
        points.setdefault(row.point, []).append(row)
    out = []
    for point, runs in points.items():
        mean, std, n = {}, {}, {}
        for m in metrics:
            vals = [r.values[m] for r in runs if r.values[m] is not None]
            n[m] = len(vals)
            mean[m] = statistics.fmean(vals) if vals else None
            std[m] = statistics.stdev(vals) if len(vals) > 1 else None
        varied = {k: v for k, v in runs[0].varied.items() if k != SEED_KEY}
        out.append(PointRow(point, varied, runs, mean, std, n))
    return out


def _cell(value: Optional[float]) -> str:
    return "" if value is None else repr(value)


def write_runs_csv(path: str, rows: Sequence[RunRow], keys: Sequence[str], metrics: Sequence[str]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "point", *keys, "state", "iteration", "train_iters", *metrics])
        for r in rows:
            w.writerow([r.name, r.point, *(format_value(r.varied.get(k)) for k in keys), r.state, r.iteration,
                        r.train_iters, *(_cell(r.values[m]) for m in metrics)])


def write_points_csv(path: str, points: Sequence[PointRow], keys: Sequence[str], metrics: Sequence[str]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["point", *keys, "runs", *(f"{m}_{s}" for m in metrics for s in ("mean", "std", "n"))])
        for p in points:
            w.writerow([p.point, *(format_value(p.varied.get(k)) for k in keys), len(p.runs),
                        *(c for m in metrics for c in (_cell(p.mean[m]), _cell(p.std[m]), p.n[m]))])


def _pm(mean: Optional[float], std: Optional[float]) -> str:
    if mean is None:
        return "-"
    return f"{mean:.4g}" if std is None or math.isnan(std) else f"{mean:.4g} ± {std:.2g}"


def write_markdown(path: str, plan: Dict, points: Sequence[PointRow], keys: Sequence[str],
                   metrics: Sequence[str], value: str, last_n: int) -> None:
    how = "final value" if value == "final" else f"mean over the last {last_n} iterations"
    lines = [f"# Sweep {plan['name']}", "",
             f"{len(points)} points, {sum(len(p.runs) for p in points)} runs ({plan['sweep_file']}). Each metric: the "
             f"{how} of each run; over seeds mean ± sample standard deviation.", "",
             "| " + " | ".join([*keys, "runs (done)", *metrics]) + " |",
             "|" + "---|" * (len(keys) + 1 + len(metrics))]
    for p in points:
        done = sum(r.state == "done" for r in p.runs)
        lines.append("| " + " | ".join([*(format_value(p.varied.get(k)) for k in keys), f"{len(p.runs)} ({done})",
                                        *(_pm(p.mean[m], p.std[m]) for m in metrics)]) + " |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
