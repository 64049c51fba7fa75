"""`report` (megatron_moe/sweep/report.py, plots.py) on hand-written run directories: the CSV holds
each run's metrics.jsonl values exactly, seeds aggregate as mean and sample std, the markdown
table, plots and TensorBoard HParams are written."""
import csv
import json
import math
import os

import numpy as np
import pytest

from megatron_moe.sweep.plots import write_report
from megatron_moe.sweep.report import metric_value, reduce_metric
from megatron_moe.training.completion import write_complete_marker

RECORD = {"iteration": 4, "loss": 2.5, "a2a_exposed_ms": {"forward": 1.25, "backward": 2.0},
          "expert_load_imbalance": [1.5, 2.5, 4.0], "moe_schedule": [{"baseline": 2}], "skipped_iterations": 0}


def test_metric_value_numbers_dicts_lists_and_dotted_parts():
    assert metric_value(RECORD, "loss") == 2.5
    assert metric_value(RECORD, "a2a_exposed_ms") == 3.25  # forward + backward
    assert metric_value(RECORD, "a2a_exposed_ms.backward") == 2.0
    assert metric_value(RECORD, "expert_load_imbalance") == pytest.approx(8.0 / 3)  # mean over layers
    assert metric_value(RECORD, "expert_load_imbalance.2") == 4.0
    assert metric_value(RECORD, "eval_ppl") is None and metric_value(RECORD, "expert_load_imbalance.3") is None
    assert metric_value(RECORD, "skipped_iterations") == 0.0


def test_reduce_final_and_mean_over_the_last_iterations():
    records = [{"iteration": i, "loss": float(i)} for i in range(1, 11)] + [{"iteration": 11}]
    records[4]["eval_ppl"] = 7.0  # logged at iteration 5 only
    assert reduce_metric(records, "loss", "final", 3) == 10.0
    assert reduce_metric(records, "loss", "mean", 3) == (9.0 + 10.0) / 2  # iterations 9..11; 11 has no loss
    assert reduce_metric(records, "eval_ppl", "mean", 3) == 7.0  # none in the window: its final value
    assert reduce_metric(records, "eval_ppl", "final", 3) == 7.0
    assert reduce_metric(records, "nothing", "final", 3) is None


def fake_sweep(tmp_path, rng):
    """2 points x 3 seeds of random metrics (one seed of point b unfinished: 3 of 5 iterations);
    the plan record `run` would write."""
    runs, truth = [], {}
    for p, balancer in enumerate(["none", "eplb"]):
        for seed in (1, 2, 3):
            name = f"balancer={balancer},seed={seed}"
            run_dir = tmp_path / "runs" / name
            run_dir.mkdir(parents=True)
            iters = 3 if (balancer, seed) == ("eplb", 2) else 5
            records = [{"iteration": i, "loss": float(rng.uniform(1, 7)), "tokens_per_sec": float(rng.uniform(1e3, 1e4)),
                        "iter_time_ms": float(rng.uniform(10, 99)),
                        "a2a_exposed_ms": {"forward": float(rng.uniform(0, 5)), "backward": float(rng.uniform(0, 5))},
                        "expert_load_imbalance": [float(x) for x in rng.uniform(1, 3, size=2)]}
                       for i in range(1, iters + 1)]
            records[-1]["eval_ppl"] = float(rng.uniform(100, 900))
            with open(run_dir / "metrics.jsonl", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
            if iters == 5:
                write_complete_marker(str(run_dir), 5)
            truth[name] = records
            runs.append({"index": len(runs) + 1, "name": name, "point": f"balancer={balancer}",
                         "varied": [["moe.balancer", balancer], ["training.seed", seed]], "overrides": [],
                         "world_size": 2, "launch": "2 processes", "run_dir": str(run_dir), "train_iters": 5})
    metrics = ["loss", "eval_ppl", "tokens_per_sec", "iter_time_ms", "a2a_exposed_ms", "expert_load_imbalance"]
    plan = {"name": "fake", "sweep_file": "fake.yaml", "sweep_dir": str(tmp_path), "backend": "local",
            "varied_keys": ["moe.balancer", "training.seed"], "metrics": metrics,
            "report": {"value": "final", "last_n": 2, "group_by": None}, "runs": runs}
    return plan, truth, metrics


def expected(records, metric, value, last_n):
    """Independent of report.py: straight from the records."""
    def number(r):
        v = r.get(metric)
        return sum(v.values()) if isinstance(v, dict) else float(np.mean(v)) if isinstance(v, list) else v
    have = [r for r in records if r.get(metric) is not None]
    if value == "final":
        return number(have[-1])
    window = [number(r) for r in have if r["iteration"] > records[-1]["iteration"] - last_n] or [number(have[-1])]
    return float(np.mean(window))


@pytest.mark.parametrize("value", ["final", "mean"])
def test_report_csv_equals_metrics_jsonl_and_seeds_aggregate(tmp_path, value):
    plan, truth, metrics = fake_sweep(tmp_path, np.random.default_rng(7))
    paths = write_report(str(tmp_path), plan, value=value)
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["run"] for r in rows] == list(truth)  # one row per run, no duplicates
    for row in rows:
        records = truth[row["run"]]
        assert row["iteration"] == str(records[-1]["iteration"])
        assert row["state"] == ("done" if len(records) == 5 else "interrupted")
        for m in metrics:
            assert float(row[m]) == pytest.approx(expected(records, m, value, 2), rel=1e-12, abs=0), (row["run"], m)
    with open(tmp_path / "results_points.csv") as f:
        points = {r["point"]: r for r in csv.DictReader(f)}
    for point, balancer in (("balancer=none", "none"), ("balancer=eplb", "eplb")):
        for m in metrics:
            vals = [expected(truth[f"balancer={balancer},seed={s}"], m, value, 2) for s in (1, 2, 3)]
            assert float(points[point][f"{m}_mean"]) == pytest.approx(np.mean(vals), rel=1e-12)
            assert float(points[point][f"{m}_std"]) == pytest.approx(np.std(vals, ddof=1), rel=1e-12)
            assert points[point][f"{m}_n"] == "3"
    md = (tmp_path / "results.md").read_text()
    mean, std = np.mean([expected(truth[f"balancer=eplb,seed={s}"], "loss", value, 2) for s in (1, 2, 3)]), \
        np.std([expected(truth[f"balancer=eplb,seed={s}"], "loss", value, 2) for s in (1, 2, 3)], ddof=1)
    assert f"| eplb | 3 (2) | {mean:.4g} ± {std:.2g} |" in md
    for name in ("loss_curves.png", "throughput.png", "a2a_exposed.png"):
        assert os.path.getsize(tmp_path / name) > 5000 and str(tmp_path / name) in paths
    check_hparams(tmp_path / "hparams", truth, metrics, value)


def check_hparams(root, truth, metrics, value):
    """One TensorBoard run per sweep run, with the HParams plugin's session data and the metrics."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    assert sorted(os.listdir(root)) == sorted(truth)
    for name, records in truth.items():
        acc = EventAccumulator(str(root / name))
        acc.Reload()
        start = HParamsPluginData.FromString(acc.PluginTagToContent("hparams")["_hparams_/session_start_info"])
        hparams = {k: v.string_value or v.number_value for k, v in start.session_start_info.hparams.items()}
        balancer, seed = name.replace("balancer=", "").replace("seed=", "").split(",")
        assert hparams == {"moe.balancer": balancer, "training.seed": int(seed)}
        got = {t: acc.Scalars(t)[-1].value for t in acc.Tags()["scalars"]}
        for m in metrics:
            assert math.isclose(got[f"sweep/{m}"], expected(records, m, value, 2), rel_tol=1e-6), (name, m)
