"""tools/sweep.py end to end on this machine (docs/sweeps.md):

* a 4-run local sweep (2 points x 2 seeds, 2 torchrun processes each) from one `run` command;
  `report` writes one CSV row per run whose values are each run's metrics.jsonl values;
* `kill -9` of the sweep and all its children in the middle of a run (1 process each): `run` again skips the
  finished run (its files untouched) and resumes the killed one from its last checkpoint; the
  report has each run once and the resumed run's metrics each iteration once;
* `plan --simulate` ranks points with the cluster simulator and prints the recommended subset.
"""
import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from megatron_moe.sweep import cli
from megatron_moe.training.checkpoint import newest_complete

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.seq_length=32", "training.log_interval=1"]


def sweep_file(tmp_path, overrides, grid, seeds=None, nproc=2, **launch):
    """nproc 2: expert parallelism over both ranks."""
    body = {"base": "configs/gpt_moe_tiny.yaml", "grid": grid, "sweep_dir": str(tmp_path / "sweep"),
            "overrides": TINY + ["parallel.expert=2"] * (nproc == 2) + overrides,
            "launch": {"backend": "local", "nproc": nproc, **launch}}
    if seeds:
        body["seeds"] = seeds
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


def sweep(*args, timeout=600, **kw):
    return subprocess.run([sys.executable, "tools/sweep.py", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, **kw)


def records(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def check_report_matches_metrics(sweep_dir, names):
    """results.csv: one row per run, each metric equal to the run's final metrics.jsonl value."""
    proc = sweep("report", sweep_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(sweep_dir / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["run"] for r in rows] == names
    for row in rows:
        recs = records(sweep_dir / "runs" / row["run"])
        assert row["state"] == "done" and int(row["iteration"]) == recs[-1]["iteration"]
        assert float(row["loss"]) == recs[-1]["loss"]
        assert float(row["tokens_per_sec"]) == recs[-1]["tokens_per_sec"]
        evals = [r["eval_ppl"] for r in recs if "eval_ppl" in r]
        assert (float(row["eval_ppl"]) if row["eval_ppl"] else None) == (evals[-1] if evals else None)
        assert float(row["a2a_exposed_ms"] or 0) == sum(recs[-1]["a2a_exposed_ms"].values())
        imbalance = recs[-1]["expert_load_imbalance"]
        assert float(row["expert_load_imbalance"]) == sum(imbalance) / len(imbalance)
    return rows


def test_four_run_local_sweep_end_to_end(tmp_path):
    path = sweep_file(tmp_path, ["training.train_iters=4", "training.eval_interval=2"],
                      {"moe.balancer": ["none", "fastermoe"]}, seeds=[1, 2], max_parallel=2)
    start = time.monotonic()
    proc = sweep("run", path)
    elapsed = time.monotonic() - start
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    names = ["balancer=none,seed=1", "balancer=none,seed=2", "balancer=fastermoe,seed=1", "balancer=fastermoe,seed=2"]
    for i, name in enumerate(names):  # one line per state change
        assert re.search(rf"\[{i + 1}/4\] {re.escape(name)}: pending -> running \(pid \d+", out), out
        assert f"[{i + 1}/4] {name}: running -> done" in out, out
    assert "4 done (of 4)" in out
    sweep_dir = tmp_path / "sweep"
    for name in names:
        run_dir = sweep_dir / "runs" / name
        assert json.loads((run_dir / "complete.json").read_text())["train_iters"] == 4
        assert [r["iteration"] for r in records(run_dir)] == [1, 2, 3, 4]
        assert all(r["comm_bytes"]["all_to_all"] > 0 for r in records(run_dir))  # 2 ranks, expert parallel
    # the seeds differ, a balancer does not change the math: same seed, same loss (within fp32
    # rounding: shadowed experts sum their gradients in another order)
    loss = {n: records(sweep_dir / "runs" / n)[-1]["loss"] for n in names}
    assert abs(loss[names[0]] - loss[names[1]]) > 1e-3
    assert loss[names[0]] == pytest.approx(loss[names[2]], rel=1e-5)
    rows = check_report_matches_metrics(sweep_dir, names)
    md = (sweep_dir / "results.md").read_text()
    assert "| none | 2 (2) |" in md and "| fastermoe | 2 (2) |" in md and " ± " in md
    assert {r["moe.balancer"] for r in rows} == {"none", "fastermoe"}
    status = sweep("status", sweep_dir)
    assert status.returncode == 0 and "4 done (of 4)" in status.stdout
    print(f"4-run local sweep: {elapsed:.1f} s")


def descendants(pid):
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def newest_checkpoint(run_dir):
    path = newest_complete(str(run_dir / "checkpoints"))
    return int(path.rsplit("_", 1)[1]) if path else 0


def test_kill_9_mid_run_then_run_again_skips_finished_and_resumes(tmp_path):
    iters = 16
    path = sweep_file(tmp_path, [f"training.train_iters={iters}", "training.eval_interval=0",
                                 "checkpoint.save_interval=3", "logging.tensorboard=false"],
                      {"moe.balancer": ["none", "eplb"]}, nproc=1)
    sweep_dir = tmp_path / "sweep"
    first, second = (sweep_dir / "runs" / n for n in ("balancer=none", "balancer=eplb"))
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "tools/sweep.py", "run", str(path)], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 400
            while not ((first / "complete.json").exists() and (second / "metrics.jsonl").exists()
                       and len(records(second)) >= 5):
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()
                time.sleep(0.1)
            tree = descendants(proc.pid)
            for pid in tree:  # freeze the whole tree first, so that no process reacts to another's death
                os.kill(pid, signal.SIGSTOP)
            for pid in tree:
                os.kill(pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
    assert len(tree) >= 3  # the sweep, torchrun, its worker
    killed_at = records(second)[-1]["iteration"]
    resume_from = newest_checkpoint(second)
    assert 3 <= resume_from <= killed_at < iters and not (second / "complete.json").exists()
    first_metrics = (first / "metrics.jsonl").read_text()
    status = sweep("status", sweep_dir)
    assert re.search(r"balancer=eplb\s+interrupted\s+" + f"{killed_at}/{iters}", status.stdout), status.stdout

    proc = sweep("run", path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 runs, 1 finished before (skipped)" in proc.stdout
    assert "balancer=none: pending" not in proc.stdout and "[2/2] balancer=eplb: pending -> running" in proc.stdout
    assert (first / "metrics.jsonl").read_text() == first_metrics  # the finished run was not run again
    log = (second / "sweep.log").read_text()
    assert log.count("sweep launch:") == 2 and (first / "sweep.log").read_text().count("sweep launch:") == 1
    assert re.search(rf"checkpoint: resumed from \S+iter_{resume_from:07d} \(iteration {resume_from}\)", log), log
    assert [r["iteration"] for r in records(second)] == list(range(1, iters + 1))  # no duplicates, no gap
    check_report_matches_metrics(sweep_dir, ["balancer=none", "balancer=eplb"])


def test_plan_simulate_ranks_points_and_recommends(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    only = ["--only", "balancer=none,schedule=baseline", "--only", "balancer=proprophet,schedule=s2"]
    assert cli.main(["plan", "configs/sweeps/paper_scale_sim.yaml", "--simulate", *only]) == 0
    out = capsys.readouterr().out
    ranked = re.findall(r"^\s+([\d.]+) ms  (\S+)\s+world 32$", out, re.M)
    assert [p for _, p in ranked] == ["balancer=proprophet,schedule=s2", "balancer=none,schedule=baseline"], out
    assert float(ranked[0][0]) < float(ranked[1][0])
    assert "recommended subset (the 2 fastest, simulate.top=3):" in out
    assert ("tools/sweep.py run configs/sweeps/paper_scale_sim.yaml --only balancer=proprophet,schedule=s2 "
            "--only balancer=none,schedule=baseline") in out
