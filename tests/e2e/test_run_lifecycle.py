"""A run's lifecycle under `scripts/run_local.sh` (issue #43, items 1-3 and 5; docs/running.md):

* Ctrl-C (SIGINT to the launcher's process group, as a terminal sends it) at iteration ~30: the
  workers finish the iteration, save, print one line and exit 0, and so does the launcher; the same
  command resumes, and every loss equals the uninterrupted run's bit for bit. A second Ctrl-C
  aborts at once: one line, exit 130, no traceback;
* a changed `moe.num_experts` against the checkpoint: the launcher prints one line, exit 2; a
  checkpoint found corrupt only by the workers: one line, exit 2, no torchrun `ChildFailedError`;
* a fresh `training.run_dir` pointed at another run's checkpoints with `checkpoint.load=auto`:
  one line, exit 2, nothing written;
* `training.eval_only` on a checkpoint prints the number training's eval printed at that iteration.
The uninterrupted reference and the eval run fork from the test's forkserver (`launch_ranks`).
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.test_train_cli import launch_ranks

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "run_local.sh"
CONFIG = "configs/gpt_moe_tiny.yaml"
ITERS = 45
RUN = [f"training.train_iters={ITERS}", "training.log_interval=1", "training.eval_interval=10",
       "training.eval_iters=1", "model.seq_length=32", "training.micro_batch_size=1", "training.global_batch_size=4",
       "parallel.expert=2", "logging.tensorboard=false", "checkpoint.save_interval=20", "checkpoint.keep_last=0",
       "checkpoint.load=auto"]


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_local(overrides, **kwargs):
    return subprocess.Popen([str(SCRIPT), "2", CONFIG] + RUN + overrides, cwd=ROOT,
                            env=dict(os.environ, PYTHON=sys.executable), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kwargs)


def ctrl_c(run_dir, after, times=1):
    """run_local.sh in a session of its own, SIGINT to that process group (a terminal's Ctrl-C) once
    `after` iterations are logged (`times` Ctrl-C 50 ms apart); returns (exit code, output)."""
    proc = run_local([f"training.run_dir={run_dir}"], start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not ((run_dir / "metrics.jsonl").exists() and len(records(run_dir)) >= after):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.05)
        for i in range(times):
            time.sleep(0.05 * i)
            os.killpg(proc.pid, signal.SIGINT)
        out = proc.communicate(timeout=180)[0]
    finally:
        proc.kill()
    return proc.returncode, out


def one_error_line(proc_args, needle):
    proc = run_local(proc_args)
    out = proc.communicate(timeout=240)[0]
    errors = [line for line in out.splitlines() if line.strip()]
    assert proc.returncode == 2, out[-3000:]
    assert len(errors) == 1 and errors[0].startswith("config error: ") and needle in errors[0], out[-3000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    proc = launch_ranks(2, RUN + [f"training.run_dir={run_dir}"], config=["--config", CONFIG])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return records(run_dir)


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("interrupted") / "run"
    code, out = ctrl_c(run_dir, after=30)
    return run_dir, code, out


def test_ctrl_c_stops_cleanly_and_resumes_bitwise(reference, interrupted):
    run_dir, code, out = interrupted
    lines = [line for line in out.splitlines() if not line.startswith(("iter ", "rank 0/2"))]
    stopped = len(records(run_dir))
    assert code == 0 and lines == [f"SIGINT: stopped after iteration {stopped}; checkpoint saved to "
                                   f"{run_dir}/checkpoints/iter_{stopped:07d}"], out[-3000:]
    assert 30 <= stopped < ITERS and not (run_dir / "complete.json").exists()
    proc = run_local([f"training.run_dir={run_dir}"])  # the same command resumes
    out = proc.communicate(timeout=240)[0]
    assert proc.returncode == 0 and f"resumed from {run_dir}/checkpoints/iter_{stopped:07d}" in out, out[-3000:]
    resumed = records(run_dir)
    keys = ("iteration", "loss", "aux_loss", "grad_norm", "lr", "eval_loss")
    assert [[r.get(k) for k in keys] for r in resumed] == [[r.get(k) for k in keys] for r in reference]


def test_second_ctrl_c_aborts_at_once(tmp_path):
    code, out = ctrl_c(tmp_path / "run", after=5, times=2)
    lines = [line for line in out.splitlines() if line.strip() and not line.startswith(("iter ", "rank 0/2"))]
    abort = "SIGINT again: aborted at once, nothing saved (resume from the last checkpoint)"
    assert code == 130 and lines == [abort], out[-3000:]


def test_changed_num_experts_is_one_line_exit_2(interrupted):
    run_dir, _, _ = interrupted
    one_error_line([f"training.run_dir={run_dir}", "moe.num_experts=16"],
                   "holds another model: moe.num_experts 8 -> 16")


def test_fresh_run_dir_never_resumes_another_runs_checkpoint(interrupted, tmp_path):
    run_dir, _, _ = interrupted
    one_error_line([f"training.run_dir={tmp_path}/other", f"checkpoint.dir={run_dir}/checkpoints", "moe.balancer=eplb"],
                   f"belongs to the run in training.run_dir={run_dir}, not to this run's {tmp_path}/other")
    assert not (tmp_path / "other").exists()


def test_checkpoint_error_found_by_the_workers_is_one_line_exit_2(interrupted, tmp_path):
    """Only loading reads the files (the config check reads names and metadata): rank 0's one line,
    exit 2, and the launcher adds no ChildFailedError report."""
    run_dir, _, _ = interrupted
    copy = shutil.copytree(run_dir / "checkpoints" / "iter_0000020", tmp_path / "copy")
    data = sorted(copy.glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    one_error_line([f"training.run_dir={tmp_path}/run", f"checkpoint.load={copy}"], f"file {data.name} has")


def test_eval_only_prints_trainings_evaluation(reference, interrupted, tmp_path):
    run_dir, _, _ = interrupted
    at20 = run_dir / "checkpoints" / "iter_0000020"
    proc = launch_ranks(2, RUN + [f"training.run_dir={tmp_path}", "training.eval_only=true", f"checkpoint.load={at20}"],
                        config=["--config", CONFIG])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    want = next(r for r in reference if r["iteration"] == 20)
    assert f"eval-only: {at20} (iteration 20) | eval loss {want['eval_loss']:.4f} ppl {want['eval_ppl']:.2f}" \
        in proc.stdout
    assert json.loads((tmp_path / "eval.jsonl").read_text())["eval_loss"] == want["eval_loss"]
