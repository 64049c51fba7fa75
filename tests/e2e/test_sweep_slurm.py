"""tools/sweep.py with `launch.backend: slurm` on the real one-node test cluster (tests/e2e/slurm_cluster.py,
the `slurm_env` fixture of tests/e2e/conftest.py): 4 runs as one submitit job array of 2-task jobs
(one srun task per rank, scripts/slurm/srun_pretrain.sh); `scancel --signal=USR1` on one array
task makes its ranks save a checkpoint and stop, the task requeues itself, SLURM starts it again
and it resumes from that checkpoint and finishes; the report covers all four runs.
"""
import csv
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
ITERS = 20


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_slurm_job_array_usr1_saves_requeues_and_finishes(slurm_env, tmp_path):
    sweep_dir = tmp_path / "sweep"
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({
        "base": "configs/gpt_moe_tiny.yaml",
        "overrides": [f"training.train_iters={ITERS}", "training.log_interval=1", "training.eval_interval=0",
                      "model.seq_length=32", "parallel.expert=2"],
        "grid": {"moe.balancer": ["none", "fastermoe"]}, "seeds": [1, 2],
        "launch": {"backend": "slurm", "nodes": 1, "tasks_per_node": 2, "time": 10, "max_parallel": 4},
        "sweep_dir": str(sweep_dir)}))
    # all four tasks run at once (8 CPUs on the test node): with none of them pending, Slurm 22.05
    # signals one task once (with pending tasks it answers "try again later" and scancel sends the
    # signal again every few seconds; docs/sweeps.md)
    target = sweep_dir / "runs" / "balancer=none,seed=2"
    start = time.monotonic()
    with open(tmp_path / "sweep.log", "w+") as log:
        proc = subprocess.Popen([sys.executable, "tools/sweep.py", "run", str(path), "--poll", "1"], cwd=ROOT,
                                env=slurm_env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while not ((target / "metrics.jsonl").exists() and len(records(target)) >= 2):
                assert proc.poll() is None and time.monotonic() < deadline, Path(log.name).read_text()
                time.sleep(0.2)
            job = json.loads((target / "sweep_state.json").read_text())["job"]
            subprocess.run(["scancel", "--signal=USR1", job], env=slurm_env, check=True, timeout=30)
            assert proc.wait(timeout=400) == 0, Path(log.name).read_text()
        finally:
            if proc.poll() is None:  # failed: kill what is left (submitit's batch process ignores SIGTERM)
                proc.kill()
                subprocess.run(["scancel", "--full", "--signal=KILL", "--name=sweep_sweep"], env=slurm_env,
                               timeout=30)
        log.seek(0)
        out = log.read()
    elapsed = time.monotonic() - start
    array = re.search(r"submitted job array (\d+) \(4 runs, 1 node x 2 tasks, 4 at a time\)", out)
    assert array, out
    assert job == f"{array.group(1)}_1"
    # the signalled task: stopped and saved on USR1, requeued itself, restarted and resumed there
    run_log = (target / "sweep.log").read_text()
    stopped = re.search(r"0: SIGUSR1: stopped after iteration (\d+); checkpoint saved to (\S+)", run_log)
    assert stopped and int(stopped.group(1)) < ITERS, run_log
    assert f"sweep job {job} (restart 0)" in run_log and f"sweep job {job} (restart 1)" in run_log
    assert re.search(rf"0: checkpoint: resumed from {re.escape(stopped.group(2))} \(iteration {stopped.group(1)}\)",
                     run_log), run_log
    assert f"[2/4] balancer=none,seed=2: running -> pending (job {job} pending" in out  # requeued
    assert out.count("[2/4] balancer=none,seed=2: pending -> running") == 2, out  # and started again
    assert [r["iteration"] for r in records(target)] == list(range(1, ITERS + 1))
    for run_dir in (sweep_dir / "runs").iterdir():
        assert json.loads((run_dir / "complete.json").read_text())["train_iters"] == ITERS
        text = (run_dir / "sweep.log").read_text()
        assert run_dir == target or text.count("sweep job ") == 1
        assert re.search(r"job \d+ \(sweep_sweep\): 2 tasks on \S+, master", text), text  # srun_pretrain.sh, 1 task per rank
        assert all(r["comm_bytes"]["all_to_all"] > 0 for r in records(run_dir))  # 2 ranks, expert parallel
    assert "4 done (of 4)" in out
    report = subprocess.run([sys.executable, "tools/sweep.py", "report", str(sweep_dir)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr
    with open(sweep_dir / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["run"] for r in rows) == sorted(p.name for p in (sweep_dir / "runs").iterdir())
    assert len(rows) == 4
    for row in rows:
        last = records(sweep_dir / "runs" / row["run"])[-1]
        assert row["state"] == "done" and float(row["loss"]) == last["loss"]
        assert float(row["tokens_per_sec"]) == last["tokens_per_sec"]
    print(f"SLURM sweep (4 runs, one requeue): {elapsed:.1f} s")
