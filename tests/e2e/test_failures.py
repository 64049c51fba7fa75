"""Failure behaviour of the real entry point (issue 5, item 3; docs/running.md).

* a stop signal (SIGUSR1, SLURM's time-limit warning; SIGTERM) reaching ONE rank stops every rank
  after the same iteration, exit 0, with a checkpoint when checkpointing is available;
* a killed rank ends a 4-process torchrun run within 60 s, non-zero, naming the rank;
* an injected NaN (`training.inject_nan_at`) is skipped and counted (`on_nonfinite: skip`, the
  parameters and optimizer state stay untouched) or stops the run with exit code 3 (`stop`).
"""
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_moe.config import load_config
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.training.checkpoint import read_meta
from megatron_moe.training.failures import NONFINITE_EXIT
from megatron_moe.training.trainer import Trainer

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "configs/gpt_moe_tiny.yaml"
SMALL = ["training.log_interval=1", "training.eval_interval=0",
         "model.seq_length=32", "training.micro_batch_size=1", "training.global_batch_size=4"]


def command(nproc, overrides):
    cmd = [sys.executable, "pretrain_gpt_moe.py"]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "pretrain_gpt_moe.py"]
    return cmd + ["--config", CONFIG] + SMALL + overrides


def start(nproc, overrides, log):
    return subprocess.Popen(command(nproc, overrides), cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            stdout=log, stderr=subprocess.STDOUT)


def records(run_dir):
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def wait_for_iterations(proc, run_dir, count, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before it was signalled"
        if (run_dir / "metrics.jsonl").exists() and len(records(run_dir)) >= count:
            return
        time.sleep(0.2)
    raise AssertionError(f"no {count} iterations logged within {timeout} s")


def worker_pid(launcher_pid, rank):
    """PID of torchrun's worker with RANK=rank (a child of the launcher)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if ppid == launcher_pid and f"RANK={rank}".encode() in env:
            return int(pid)
    raise AssertionError(f"no worker with RANK={rank} under PID {launcher_pid}")


@pytest.mark.parametrize("nproc,sig,rank,checkpoint", [(2, signal.SIGUSR1, 1, True), (1, signal.SIGTERM, 0, False)],
                         ids=["usr1-to-rank1-of-2-checkpoint", "term-1proc-default-checkpoint-dir"])
def test_stop_signal_finishes_iteration_and_exits_0(tmp_path, nproc, sig, rank, checkpoint):
    run_dir = tmp_path / "run"
    ckpt = [f"checkpoint.dir={tmp_path / 'ckpt'}"] if checkpoint else []
    with open(tmp_path / "log", "w+") as log:
        proc = start(nproc, ["training.train_iters=500", f"training.run_dir={run_dir}"] + ckpt, log)
        try:
            wait_for_iterations(proc, run_dir, 2)
            os.kill(worker_pid(proc.pid, rank) if nproc > 1 else proc.pid, sig)
            assert proc.wait(timeout=120) == 0
        finally:
            proc.kill()
        log.seek(0)
        out = log.read()
    m = re.search(r"(\S+|a stop signal on another rank): stopped after iteration (\d+); (.*)", out)
    assert m, out[-3000:]
    assert m.group(1) == (sig.name if rank == 0 else "a stop signal on another rank")
    stopped = int(m.group(2))
    logged = records(run_dir)
    assert 2 <= stopped < 500 and logged[-1]["iteration"] == stopped  # the last iteration is logged
    assert not (run_dir / "complete.json").exists()  # stopped early: no completion marker (docs/sweeps.md)
    assert all(r["skipped_iterations"] == 0 for r in logged)
    saved = re.fullmatch(r"checkpoint saved to (\S+)", m.group(3).strip())
    assert saved and os.path.isdir(saved.group(1)), m.group(3)
    assert read_meta(saved.group(1))["iteration"] == stopped
    # without checkpoint.dir: the run's own <run_dir>/checkpoints (issue #43)
    assert Path(saved.group(1)).parent == (tmp_path / "ckpt" if checkpoint else run_dir / "checkpoints")


def test_killed_rank_ends_the_run_within_60s_naming_it(tmp_path):
    run_dir = tmp_path / "run"
    with open(tmp_path / "log", "w+") as log:
        proc = start(4, ["training.train_iters=1000", "parallel.expert=2", f"training.run_dir={run_dir}"], log)
        try:
            wait_for_iterations(proc, run_dir, 1)
            os.kill(worker_pid(proc.pid, 2), signal.SIGKILL)
            killed = time.monotonic()
            rc = proc.wait(timeout=90)
            elapsed = time.monotonic() - killed
        finally:
            proc.kill()
        log.seek(0)
        out = log.read()
    assert rc != 0
    assert elapsed < 60, f"the run took {elapsed:.1f} s to end after rank 2 died"
    cause = out[out.index("Root Cause"):]  # torchrun's failure summary
    assert re.search(r"rank\s*:\s*2 \(local_rank: 2\)", cause) and "SIGKILL" in cause, cause


def test_nan_skip_propagates_from_one_rank(tmp_path):
    """NaN in rank 0's loss only: the dp all-reduce spreads it; both ranks skip the same update."""
    proc = subprocess.run(command(2, ["training.train_iters=3", "training.inject_nan_at=2",
                                      "training.on_nonfinite=skip", f"training.run_dir={tmp_path}"]),
                          cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r1, r2, r3 = records(tmp_path)
    assert math.isfinite(r1["grad_norm"]) and r1["skipped_iterations"] == 0
    assert math.isnan(r2["loss"]) and math.isnan(r2["grad_norm"]) and r2["skipped_iterations"] == 1
    assert math.isfinite(r3["loss"]) and math.isfinite(r3["grad_norm"]) and r3["skipped_iterations"] == 1
    assert "skipped 1 non-finite" in proc.stdout
    assert json.loads((tmp_path / "complete.json").read_text())["train_iters"] == 3  # reached train_iters




def test_nan_skip_leaves_parameters_and_optimizer_untouched(tmp_path, one_thread):
    overrides = SMALL + ["training.inject_nan_at=2", "training.on_nonfinite=skip", f"training.run_dir={tmp_path}"]
    trainer = Trainer(load_config(str(ROOT / CONFIG), overrides), ParallelState.single_process())
    trainer.train_step(1)
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    steps = {n: trainer.optimizer.state[p]["step"].clone() for n, p in trainer.model.named_parameters()}
    record = trainer.train_step(2)
    assert math.isnan(record["grad_norm"]) and record["skipped_iterations"] == 1
    for n, p in trainer.model.named_parameters():
        assert torch.equal(p.detach(), params[n]), n
        assert torch.equal(trainer.optimizer.state[p]["step"], steps[n]), n
    assert math.isfinite(trainer.train_step(3)["loss"])
    assert any(not torch.equal(p.detach(), params[n]) for n, p in trainer.model.named_parameters())


def test_nan_stop_exits_3_with_message(tmp_path):
    proc = subprocess.run(command(1, ["training.train_iters=3", "training.inject_nan_at=2",
                                      "training.on_nonfinite=stop", f"training.run_dir={tmp_path}"]),
                          cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == NONFINITE_EXIT == 3
    assert proc.stderr.strip().splitlines()[-1] == (
        "stopped: iteration 2: non-finite loss nan or grad norm nan; stopping without applying it "
        "(training.on_nonfinite=stop)")
    assert [r["iteration"] for r in records(tmp_path)] == [1]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "complete.json").exists()


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    """A real checkpoint of 2 tiny iterations: <tmp>/ckpt/iter_0000002."""
    tmp = tmp_path_factory.mktemp("saved")
    proc = subprocess.run(command(1, ["training.train_iters=2", f"training.run_dir={tmp / 'run'}",
                                      f"checkpoint.dir={tmp / 'ckpt'}", "checkpoint.save_interval=2"]),
                          cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp / "ckpt" / "iter_0000002"


def _bad_checkpoint(case, saved, tmp_path):
    """(checkpoint.load path, extra overrides, what the message must say) for one kind of bad load."""
    if case == "missing":
        return tmp_path / "does" / "not" / "exist", [], "does not exist"
    if case == "empty":
        (tmp_path / "empty").mkdir()
        return tmp_path / "empty", [], "is not a checkpoint"
    copy = tmp_path / "copy"
    shutil.copytree(saved, copy)
    if case == "batch_size":  # a complete checkpoint, resumed with another global batch size
        return copy, ["training.global_batch_size=8"], "same global batch size"
    data = sorted(copy.glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])  # truncated
    return copy, [], f"file {data.name} has"


@pytest.mark.parametrize("case", ["missing", "empty", "truncated", "batch_size"])
def test_bad_checkpoint_load_is_one_config_error(saved_checkpoint, tmp_path, case):
    """Early (validate: missing, empty) or while resuming (truncated file, other global batch size):
    exit 2 and one stderr line naming checkpoint.load and the path, no traceback."""
    path, extra, reason = _bad_checkpoint(case, saved_checkpoint, tmp_path)
    proc = subprocess.run(command(1, ["training.train_iters=4", f"training.run_dir={tmp_path / 'run'}",
                                      f"checkpoint.load={path}"] + extra),
                          cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"config error: checkpoint.load={path}: ") and reason in lines[0], lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
