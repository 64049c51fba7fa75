"""The report's pictures and TensorBoard HParams (report.py computes the numbers).

    loss_curves.png   curves over iterations, one line per point (the mean over its seeds, on the
                      iterations every seed logged): with a group key, the loss, one panel per value
                      of the key; overlaid (`--group-by none`, the default when one key varies), one
                      panel per metric with every point in it
    throughput.png    tokens/s per point (mean ± std over seeds, value as `report.value` says)
    a2a_exposed.png   exposed token all-to-all time per point, forward and backward stacked
    hparams/<run>/    one TensorBoard run per sweep run with its varied keys as hyperparameters and
                      the report's metrics: `tensorboard --logdir <sweep_dir>/hparams`, HParams tab
"""
from __future__ import annotations

import math
import os
import shutil
import statistics
from typing import Dict, List, Optional, Sequence

from megatron_moe.sweep.report import (PointRow, RunRow, aggregate, collect, metric_value, reduce_metric,
                                       write_markdown, write_points_csv, write_runs_csv)
from megatron_moe.sweep.spec import NO_GROUP, SEED_KEY, format_value


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def mean_curve(runs: Sequence[RunRow], metric: str = "loss"):
    """(iterations, mean over the runs) on the iterations where every run has the metric."""
    curves = [{r["iteration"]: v for r in run.records if (v := metric_value(r, metric)) is not None} for run in runs]
    common = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    return common, [statistics.fmean(c[i] for c in curves) for i in common]


def _label(point: PointRow, group_by: Optional[str]) -> str:
    parts = [f"{k.rsplit('.', 1)[-1]}={format_value(v)}" for k, v in point.varied.items() if k != group_by]
    return ",".join(parts) or point.point


def curves_figure(points: Sequence[PointRow], group_by: Optional[str], metrics: Sequence[str] = ("loss",)):
    """The loss_curves.png figure. `group_by` a key: one panel per value of it, the loss of its
    points; None (overlay): one panel per metric that some point logged, every point in it."""
    plt = _pyplot()
    panels: Dict[str, List[PointRow]] = {}
    if group_by:
        for p in points:
            panels.setdefault(format_value(p.varied.get(group_by)), []).append(p)
        curves = {value: [(p, "loss") for p in members] for value, members in panels.items()}
    else:
        curves = {m: [(p, m) for p in points] for m in metrics}
    lines = {title: [(p, *mean_curve(p.runs, m)) for p, m in members] for title, members in curves.items()}
    lines = {title: [c for c in members if c[1]] for title, members in lines.items()}
    lines = {title: members for title, members in lines.items() if members} or {"loss": []}
    cols = min(len(lines), 3)
    rows = math.ceil(len(lines) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False, sharey=bool(group_by))
    for ax, (title, members) in zip(axes.flat, lines.items()):
        for p, its, values in members:
            ax.plot(its, values, label=_label(p, group_by), linewidth=1.2, marker="." if len(its) < 3 else None)
        ax.set_title(f"{group_by} = {title}" if group_by else title, fontsize=9)
        ax.set_xlabel("iteration")
        if not group_by:
            ax.set_ylabel(f"{title} (mean over seeds)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(lines):]:
        ax.remove()
    if group_by:
        axes[0][0].set_ylabel("loss (mean over seeds)")
    return fig


def plot_loss_curves(path: str, points: Sequence[PointRow], group_by: Optional[str],
                     metrics: Sequence[str] = ("loss",)) -> str:
    return _save(curves_figure(points, group_by, metrics), path)


def _per_point(points: Sequence[PointRow], metric: str, value: str, last_n: int):
    """(mean, std) over each point's seeds of `metric` reduced like the report's columns."""
    out = []
    for p in points:
        vals = [v for r in p.runs if (v := reduce_metric(r.records, metric, value, last_n)) is not None]
        out.append((statistics.fmean(vals) if vals else 0.0, statistics.stdev(vals) if len(vals) > 1 else 0.0))
    return out


def plot_bars(path: str, points: Sequence[PointRow], parts: Sequence[str], xlabel: str, value: str,
              last_n: int) -> str:
    """Horizontal bars per point, `parts` (metrics) stacked; error bars on a single part."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(points) + 1.5))
    names = [p.point for p in points]
    left = [0.0] * len(points)
    for part in parts:
        stats = _per_point(points, part, value, last_n)
        means = [m for m, _ in stats]
        ax.barh(names, means, left=left, xerr=[s for _, s in stats] if len(parts) == 1 else None,
                label=part.split(".")[-1], capsize=3)
        left = [a + b for a, b in zip(left, means)]
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(axis="x", alpha=0.3)
    if len(parts) > 1:
        ax.legend(fontsize=8)
    return _save(fig, path)


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    fig.clf()
    _pyplot().close(fig)
    return path


def plot_all(sweep_dir: str, points: Sequence[PointRow], group_by: Optional[str], value: str, last_n: int,
             metrics: Sequence[str] = ("loss",)) -> List[str]:
    how = "final" if value == "final" else f"mean of the last {last_n} iterations"
    return [plot_loss_curves(os.path.join(sweep_dir, "loss_curves.png"), points, group_by, metrics),
            plot_bars(os.path.join(sweep_dir, "throughput.png"), points, ["tokens_per_sec"],
                      f"tokens/s ({how}; mean ± std over seeds)", value, last_n),
            plot_bars(os.path.join(sweep_dir, "a2a_exposed.png"), points,
                      ["a2a_exposed_ms.forward", "a2a_exposed_ms.backward"],
                      f"exposed all-to-all ms per iteration ({how}; mean over seeds)", value, last_n)]


def _hparam(value):
    return value if isinstance(value, (int, float, str)) and not isinstance(value, bool) else format_value(value)


def write_hparams(sweep_dir: str, rows: Sequence[RunRow], keys: Sequence[str], metrics: Sequence[str]) -> str:
    """One TensorBoard run per sweep run under <sweep_dir>/hparams (rewritten each time)."""
    from torch.utils.tensorboard import SummaryWriter

    root = os.path.join(sweep_dir, "hparams")
    shutil.rmtree(root, ignore_errors=True)
    discrete = {k: sorted({str(_hparam(r.varied.get(k))) for r in rows}) for k in keys
                if any(isinstance(_hparam(r.varied.get(k)), str) for r in rows)}
    for r in rows:
        hparams = {k: (str(_hparam(r.varied.get(k))) if k in discrete else _hparam(r.varied.get(k))) for k in keys}
        values = {f"sweep/{m}": v for m, v in r.values.items() if v is not None}
        with SummaryWriter(os.path.join(root, r.name)) as writer:
            writer.add_hparams(hparams, values, hparam_domain_discrete=discrete, run_name=".")
    return root


def curve_group(group_by: Optional[str], keys: Sequence[str]) -> Optional[str]:
    """The loss-curve panels' key: `group_by` as given; `none` overlays (None); unset: the first
    varied key when several vary, else overlay (one key: one line per value in each panel)."""
    if group_by == NO_GROUP:
        return None
    return group_by or (keys[0] if len(keys) > 1 else None)


def write_report(sweep_dir: str, plan: Dict, group_by: Optional[str] = None, value: Optional[str] = None,
                 last_n: Optional[int] = None) -> List[str]:
    """Write the report files into `sweep_dir`; return their paths."""
    opts = plan["report"]
    value, last_n = value or opts["value"], last_n or opts["last_n"]
    metrics = plan["metrics"]
    keys = [k for k in plan["varied_keys"] if k != SEED_KEY]
    rows = collect(plan, metrics, value, last_n)
    points = aggregate(rows, metrics)
    paths = [os.path.join(sweep_dir, name) for name in ("results.csv", "results_points.csv", "results.md")]
    write_runs_csv(paths[0], rows, plan["varied_keys"], metrics)
    write_points_csv(paths[1], points, keys, metrics)
    write_markdown(paths[2], plan, points, keys, metrics, value, last_n)
    paths += plot_all(sweep_dir, points, curve_group(group_by or opts["group_by"], keys), value, last_n, metrics)
    paths.append(write_hparams(sweep_dir, rows, plan["varied_keys"], metrics))
    return paths
