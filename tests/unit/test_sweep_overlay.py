"""The report's curves overlaid (issue #43 item 9): with one varied key, loss_curves.png has one
panel per metric with every point in it (not one panel per value with one line each); `--group-by
none` (or report.group_by: none) overlays any sweep; a group key keeps one panel per value."""
import json
import os

import pytest

from megatron_moe.sweep import cli, plots
from megatron_moe.sweep.plan import PLAN_FILE

METRICS = ["loss", "tokens_per_sec", "a2a_exposed_ms", "eval_ppl"]


def fake_sweep(tmp_path, grid, seeds=(1, 2)):
    """One run per grid point and seed, 4 iterations each (eval_ppl nowhere); plan.json written."""
    runs = []
    for point_index, point in enumerate(grid):
        for seed in seeds:
            varied = [*point.items(), ("training.seed", seed)]
            name = ",".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in varied)
            run_dir = tmp_path / "runs" / name
            run_dir.mkdir(parents=True)
            with open(run_dir / "metrics.jsonl", "w") as f:
                for i in range(1, 5):
                    f.write(json.dumps({"iteration": i, "loss": 5.0 - i * (point_index + 1) / 10 + seed / 100,
                                        "tokens_per_sec": 1000.0 * (point_index + 1),
                                        "a2a_exposed_ms": {"forward": 1.0, "backward": 2.0}}) + "\n")
            runs.append({"index": len(runs) + 1, "name": name, "point": name.rsplit(",", 1)[0],
                         "varied": [list(kv) for kv in varied], "overrides": [], "world_size": 1,
                         "launch": "1 process", "run_dir": str(run_dir), "train_iters": 4})
    plan = {"name": "fake", "sweep_file": "fake.yaml", "sweep_dir": str(tmp_path), "backend": "local",
            "varied_keys": [*grid[0], "training.seed"], "metrics": METRICS,
            "report": {"value": "final", "last_n": 2, "group_by": None}, "runs": runs}
    (tmp_path / PLAN_FILE).write_text(json.dumps(plan))
    return plan


@pytest.fixture()
def figures(monkeypatch):
    """{file name: the matplotlib figure written to it}, recorded as the report saves them."""
    saved, save = {}, plots._save

    def record(fig, path):
        saved[os.path.basename(path)] = [(ax.get_title(), len(ax.get_lines())) for ax in fig.axes]
        return save(fig, path)

    monkeypatch.setattr(plots, "_save", record)
    return saved


BALANCERS = [{"moe.balancer": b} for b in ("none", "eplb", "fastermoe")]


def test_one_varied_key_overlays_the_points_one_panel_per_metric(tmp_path, figures, capsys):
    plan = fake_sweep(tmp_path, BALANCERS)
    plots.write_report(str(tmp_path), plan)
    # eval_ppl: logged by no run, no panel; each panel: the three balancers, one line each
    assert figures["loss_curves.png"] == [("loss", 3), ("tokens_per_sec", 3), ("a2a_exposed_ms", 3)]
    assert cli.main(["report", str(tmp_path), "--group-by", "none"]) == 0
    assert figures["loss_curves.png"] == [("loss", 3), ("tokens_per_sec", 3), ("a2a_exposed_ms", 3)]
    assert f"wrote {tmp_path}/loss_curves.png" in capsys.readouterr().out.replace(os.getcwd() + "/", "")
    assert cli.main(["report", str(tmp_path), "--group-by", "moe.balancer"]) == 0  # asked for: a panel per value
    assert figures["loss_curves.png"] == [("moe.balancer = none", 1), ("moe.balancer = eplb", 1),
                                          ("moe.balancer = fastermoe", 1)]
    assert cli.main(["report", str(tmp_path), "--group-by", "moe.schedule"]) == 2
    assert "sweep error: report.group_by=moe.schedule is not a varied key (varied: moe.balancer) or none" \
        in capsys.readouterr().err


def test_two_varied_keys_group_by_the_first_unless_none(tmp_path, figures):
    grid = [{"moe.balancer": b, "moe.top_k": k} for b in ("none", "eplb") for k in (1, 2)]
    plan = fake_sweep(tmp_path, grid, seeds=(1,))
    plots.write_report(str(tmp_path), plan)
    assert figures["loss_curves.png"] == [("moe.balancer = none", 2), ("moe.balancer = eplb", 2)]
    plots.write_report(str(tmp_path), plan, group_by="none")
    assert figures["loss_curves.png"] == [("loss", 4), ("tokens_per_sec", 4), ("a2a_exposed_ms", 4)]
    plan["report"]["group_by"] = "none"  # the sweep file's report.group_by
    plots.write_report(str(tmp_path), plan)
    assert figures["loss_curves.png"][0] == ("loss", 4)
