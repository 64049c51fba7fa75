"""The sweep's SLURM backend (megatron_moe/sweep/slurm.py) without a cluster: stand-in `sbatch` and
`scontrol` executables on PATH (the subprocess boundary) capture the job array's batch script and
answer `scontrol show job`; the ranks' launcher (srun_pretrain.sh) is replaced by its exit code.
tests/e2e/test_sweep_slurm.py runs the same code on a real one-node cluster, but cannot tell a
wrong `--signal` flag or array throttle apart, nor reach a cancelled or timed-out job."""
import os
import signal
import subprocess

import pytest
import yaml

from megatron_moe.sweep import slurm
from megatron_moe.sweep.spec import ROOT, expand, load_sweep
from megatron_moe.sweep.state import LOG_FILE, read_state, run_status

TINY = str(ROOT / "configs" / "gpt_moe_tiny.yaml")
JOB = "4242_3"  # the array task RunTask runs as (SLURM_ARRAY_JOB_ID _ SLURM_ARRAY_TASK_ID)
FAKE_TOOLS = {
    # copies the batch script submitit wrote, answers as sbatch does
    "sbatch": 'cp "$1" "$FAKE_SLURM_DIR/submission.sh"\necho "Submitted batch job 4242"\n',
    # logs each call; `show job` prints the one-line record (-o) with $FAKE_JOB_STATE, or fails as for
    # a job id the controller does not know
    "scontrol": 'echo "$*" >> "$FAKE_SLURM_DIR/scontrol.calls"\n'
                'if [ "$1" = show ]; then\n'
                '  [ -n "$FAKE_JOB_STATE" ] ||\n'
                '    { echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1; }\n'
                '  echo "JobId=4245 ArrayJobId=4242 ArrayTaskId=3 JobName=sweep_s UserId=u(1000) '
                'JobState=$FAKE_JOB_STATE Reason=None Dependency=(null) Requeue=1 Restarts=1"\n'
                'fi\n',
    "srun": "exit 99\n", "squeue": "exit 99\n"}  # require_submitit checks that they exist; never called here


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """A bin directory of FAKE_TOOLS first on PATH; returns the directory their files go to."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, body in FAKE_TOOLS.items():
        path = bin_dir / tool
        path.write_text("#!/bin/sh\n" + body)
        path.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM_DIR", str(tmp_path))
    return tmp_path


def sbatch_lines(text):
    return [line for line in text.splitlines() if line.startswith("#SBATCH")]


def test_job_array_signals_the_ranks_and_runs_max_parallel_at_a_time(fake_slurm, tmp_path, capsys):
    """5 runs at launch.max_parallel 2: one array of 5 tasks throttled to 2 (`%2`), and the time-limit
    warning `--signal=USR1@<signal_delay_s>` (no `B:`) with --requeue."""
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({
        "name": "s", "base": TINY, "seeds": [1, 2, 3, 4, 5], "sweep_dir": str(tmp_path / "sw"),
        "launch": {"backend": "slurm", "nodes": 1, "tasks_per_node": 2, "time": 10, "max_parallel": 2,
                   "signal_delay_s": 90}}))
    spec = load_sweep(str(path))
    runs = expand(spec)
    jobs = slurm.submit(spec, runs)
    assert jobs == {r.name: f"4242_{i}" for i, r in enumerate(runs)}
    assert all(read_state(r.run_dir)["state"] == "submitted" for r in runs)
    assert "submitted job array 4242 (5 runs, 1 node x 2 tasks, 2 at a time)" in capsys.readouterr().out
    lines = sbatch_lines((fake_slurm / "submission.sh").read_text())
    # the array's throttle: at most launch.max_parallel tasks run at once (not 5, not submitit's 256)
    assert [line for line in lines if line.startswith("#SBATCH --array")] == ["#SBATCH --array=0-4%2"]
    # The signal goes to every job step, i.e. to the ranks srun started, whose handler saves a
    # checkpoint and stops (training/failures.py). It must NOT be `B:USR1@...`: that signals only
    # the batch shell (submitit's process running RunTask, which ignores USR1), so no rank would save
    # and the time limit would kill the run, losing everything since its last checkpoint.
    assert [line for line in lines if line.startswith("#SBATCH --signal")] == ["#SBATCH --signal=USR1@90"]
    assert {"#SBATCH --requeue", "#SBATCH --time=10", "#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=2",
            "#SBATCH --job-name=sweep_s"} <= set(lines)


@pytest.fixture
def run_task(fake_slurm, tmp_path, monkeypatch):
    """RunTask of array task JOB (restart 1) whose ranks' launcher exits with `launch.code`; restores
    SIGUSR1's handler (RunTask makes its process ignore it)."""
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    run_dir = tmp_path / "runs" / "seed=1"

    def launch(cmd, stdout, stderr, cwd, env):
        assert cmd[:4] == ["bash", str(ROOT / "scripts" / "slurm" / "srun_pretrain.sh"), "pretrain_gpt_moe.py",
                           "--config"]
        assert env["MEGATRON_MOE_REQUEUE"] == "caller"  # the script must not requeue the job too
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN  # the batch process outlives the ranks' USR1
        stdout.write("0: SIGUSR1: stopped after iteration 3; checkpoint saved to ckpt/iter_0000003\n"
                     if launch.code != 1 else "1: RuntimeError: Connection closed by peer\n")
        return launch.code

    monkeypatch.setattr(subprocess, "call", launch)
    old = signal.getsignal(signal.SIGUSR1)
    yield slurm.RunTask("seed=1", "pretrain_gpt_moe.py", TINY, ("training.seed=1",), str(run_dir), str(ROOT)), launch
    signal.signal(signal.SIGUSR1, old)


def scontrol_calls(fake_slurm):
    path = fake_slurm / "scontrol.calls"
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.parametrize("code", [0, 128 + signal.SIGUSR1, 128 + signal.SIGTERM, -signal.SIGTERM])
def test_stopped_task_requeues_itself_only_while_its_job_is_running(run_task, fake_slurm, monkeypatch, code):
    """Ranks stopped by a signal: while SLURM still has the job RUNNING (its time-limit warning, or
    `scancel --signal=USR1`), the task requeues itself; a job that was cancelled, timed out or that
    scontrol cannot find is SLURM's to end: no `scontrol requeue`, the run is `interrupted`."""
    task, launch = run_task
    launch.code = code
    for state in ("CANCELLED", "TIMEOUT", ""):
        monkeypatch.setenv("FAKE_JOB_STATE", state)
        assert task() == "stopped", state
        st = read_state(task.run_dir)
        assert (st["state"], st["job"], st["exit_code"], st["job_state"]) == ("stopped", JOB, code, state or "UNKNOWN")
        status = run_status(task.run_dir, 10, {})
        assert (status.state, status.detail) == ("interrupted",
                                                 f"job {JOB} ended ({state or 'UNKNOWN'}); `run` resumes it")
    assert scontrol_calls(fake_slurm) == [f"show job -o {JOB}"] * 3  # asked, never requeued
    monkeypatch.setenv("FAKE_JOB_STATE", "RUNNING")
    assert task() == "requeued"
    assert scontrol_calls(fake_slurm)[3:] == [f"show job -o {JOB}", f"requeue {JOB}"]
    st = read_state(task.run_dir)
    assert (st["state"], st["restarts"]) == ("requeued", 2)
    status = run_status(task.run_dir, 10, {JOB: ("PENDING", "BeginTime")})
    assert (status.state, status.detail) == ("pending", f"job {JOB} pending (BeginTime), requeued 2x")


def test_failed_task_records_its_error_and_is_not_requeued(run_task, fake_slurm, monkeypatch):
    """Any other exit code is a failure, with its error line: not requeued, SLURM not even asked."""
    task, launch = run_task
    launch.code = 1
    monkeypatch.setenv("FAKE_JOB_STATE", "RUNNING")
    with pytest.raises(RuntimeError, match="run seed=1: exit code 1: RuntimeError: Connection closed by peer"):
        task()
    assert read_state(task.run_dir)["state"] == "failed" and scontrol_calls(fake_slurm) == []
    with open(os.path.join(task.run_dir, LOG_FILE)) as log:
        assert f"sweep job {JOB} (restart 1)" in log.read()
