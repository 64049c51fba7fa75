"""The SLURM backend: one submitit job array per resource shape (`launch.py`: nodes, tasks per
node, GPUs, CPUs, partition, account, time), `launch.max_parallel` array tasks at a time.

Each array task is one run. Its batch script (submitit's, `use_srun=False`) runs `RunTask` once,
which runs `scripts/slurm/srun_pretrain.sh ENTRY --config BASE overrides...` (the body of the
sbatch scripts: the config check for `SLURM_NTASKS` ranks, then `srun --kill-on-bad-exit`, one task
per rank) with the run's output appended to `<run_dir>/sweep.log`.

Signals, and how they fit submitit's own checkpoint/requeue machinery: the array has
`--signal=USR1@<launch.signal_delay_s>` (180 s, as the sbatch scripts), which SLURM (and
`scancel --signal=USR1`) delivers to the job steps: the ranks. The trainer's handler
(training/failures.py) finishes the iteration, saves a checkpoint and exits 0 on every rank. Back
in the batch script, `RunTask` sees no completion marker and requeues its own array task
(`scontrol requeue`; it runs scripts/slurm/srun_pretrain.sh with `MEGATRON_MOE_REQUEUE=caller`, so
the script leaves the requeue to it); SLURM restarts it (after `AuthInfo=cred_expire`, 120 s by default) and the
run resumes from that checkpoint (`checkpoint.load=auto`). Ranks killed by SIGUSR1 / SIGTERM
before their training loop catches it are requeued alike (`STOPPED`), but only while the job is
still RUNNING: a job that `scancel` cancelled (SIGTERM to everything), or that SLURM itself times
out or requeues, is left to SLURM and the run is `interrupted` (a later `run` resumes it). Any
other failure is recorded with its error line. submitit's handler, which checkpoints a `Checkpointable` and
requeues at once from rank 0, is not used: it would kill the ranks before they have agreed on a
stop iteration and saved. The callable is not `Checkpointable`, submitit's signal (USR2) is never
sent, and the batch process ignores USR1 in case `scancel --batch` or `--full` sends it there.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_moe.config import ConfigError
from megatron_moe.sweep.spec import ROOT, Run, SweepSpec
from megatron_moe.sweep.state import LOG_FILE, Announcer, error_line, log_since, now, read_state, run_status, \
    write_state
from megatron_moe.training.completion import read_complete_marker

POLL_S = 10.0
# exit codes of srun_pretrain.sh after a stop signal: 0 (the ranks saved and stopped), a rank killed
# by SIGUSR1 / SIGTERM before its training loop handles them (128 + n), the script itself killed (-n)
STOPPED = {0} | {s for sig in (signal.SIGUSR1, signal.SIGTERM) for s in (128 + sig, -sig)}


def require_submitit():
    missing = [tool for tool in ("sbatch", "srun", "squeue", "scontrol") if shutil.which(tool) is None]
    if missing:
        raise ConfigError(f"launch.backend=slurm: {', '.join(missing)} not found (run on a SLURM login node)")
    try:
        import submitit
    except ImportError:
        raise ConfigError("launch.backend=slurm needs submitit: pip install -e '.[sweep]'") from None
    return submitit


def job_state(job: str) -> str:
    """SLURM's state of `job` (RUNNING, CANCELLED, TIMEOUT, PREEMPTED, ...), UNKNOWN if it cannot tell."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=60)
    m = re.search(r"\bJobState=(\S+)", out.stdout)
    return m.group(1) if m else "UNKNOWN"


def job_id_here() -> str:
    """This job's id as squeue prints it: `<array job>_<task>` for an array task."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else os.environ["SLURM_JOB_ID"]


@dataclass(frozen=True)
class RunTask:
    """What one array task executes (pickled by submitit, called once in the batch script)."""
    name: str
    entry: str
    base: str
    overrides: Tuple[str, ...]
    run_dir: str
    cwd: str

    def __call__(self) -> str:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # for the ranks (job steps); this process must outlive it
        if read_complete_marker(self.run_dir) is not None:
            return "done"
        job, restarts = job_id_here(), int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        write_state(self.run_dir, state="running", backend="slurm", job=job, restarts=restarts,
                    host=os.uname().nodename, started=now(), error=None)
        cmd = ["bash", str(ROOT / "scripts" / "slurm" / "srun_pretrain.sh"), self.entry, "--config", self.base,
               *self.overrides]
        with open(os.path.join(self.run_dir, LOG_FILE), "a") as log:
            offset = log.tell()
            log.write(f"===== {now()} sweep job {job} (restart {restarts}): {' '.join(cmd)}\n")
            log.flush()
            code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.cwd,
                                   env=dict(os.environ, PYTHON=sys.executable, MEGATRON_MOE_REQUEUE="caller"))
        if read_complete_marker(self.run_dir) is not None:
            write_state(self.run_dir, state="done", exit_code=code)
            return "done"
        if code in STOPPED:  # stopped by a signal (saved when the training loop ran)
            state = job_state(job)
            if state != "RUNNING":  # cancelled (scancel), or SLURM ends or requeues it itself: not ours to requeue
                write_state(self.run_dir, state="stopped", exit_code=code, error=None, job_state=state)
                return "stopped"
            write_state(self.run_dir, state="requeued", restarts=restarts + 1)  # go on in a new start
            subprocess.run(["scontrol", "requeue", job], check=True, timeout=60)
            return "requeued"
        error = f"exit code {code}: {error_line(log_since(self.run_dir, offset))}"
        write_state(self.run_dir, state="failed", exit_code=code, error=error)
        raise RuntimeError(f"run {self.name}: {error}")


def submit(spec: SweepSpec, runs: Sequence[Run]) -> Dict[str, str]:
    """Submit `runs`, one array per resource shape; return run name -> job id (`<array>_<task>`)."""
    submitit = require_submitit()
    shapes: Dict[tuple, List[Run]] = defaultdict(list)
    for run in runs:
        shapes[run.launch.shape].append(run)
    jobs: Dict[str, str] = {}
    for group in shapes.values():
        la = group[0].launch
        executor = submitit.SlurmExecutor(folder=os.path.join(spec.sweep_dir, "slurm", "%j"))
        params = {k: v for k, v in (("partition", la.partition), ("account", la.account),
                                    ("gpus_per_node", la.gpus_per_node), ("cpus_per_task", la.cpus_per_task))
                  if v is not None}
        executor.update_parameters(
            job_name=f"sweep_{spec.name}", nodes=la.nodes, ntasks_per_node=la.tasks_per_node, time=la.time_min,
            array_parallelism=la.max_parallel, use_srun=False, stderr_to_stdout=True, **params,
            additional_parameters={**dict(la.sbatch), "signal": f"USR1@{la.signal_delay_s}", "requeue": True})
        with executor.batch():
            submitted = [executor.submit(RunTask(r.name, spec.entry, spec.base, tuple(r.overrides), r.run_dir,
                                                 os.getcwd())) for r in group]
        for run, job in zip(group, submitted):
            jobs[run.name] = job.job_id
            write_state(run.run_dir, state="submitted", backend="slurm", job=job.job_id, overrides=run.overrides,
                        submitted=now(), error=None)
        print(f"submitted job array {submitted[0].job_id.split('_')[0]} ({len(group)} runs, {la.describe()}, "
              f"{la.max_parallel} at a time): " + ", ".join(f"{j.job_id} {r.name}" for r, j in zip(group, submitted)),
              flush=True)
    return jobs


def squeue_states(job_ids: Sequence[str]) -> Optional[Dict[str, Tuple[str, str]]]:
    """job id -> (state, reason) for the jobs (array tasks one by one) still in the queue; None if
    squeue cannot be asked."""
    arrays = sorted({j.split("_")[0] for j in job_ids if j})
    if not arrays:
        return {}
    try:
        out = subprocess.run(["squeue", "-h", "-r", "-o", "%i|%T|%r", "-j", ",".join(arrays)], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        # squeue fails on ids the controller has forgotten: then none of them is queued
        return {} if "Invalid job id" in out.stderr else None
    states = {}
    for line in out.stdout.splitlines():
        job, state, reason = (line.split("|") + ["", ""])[:3]
        states[job.strip()] = (state.strip(), reason.strip())
    return states


def wait(runs: Sequence[Run], train_iters: Dict[str, int], announce: Announcer, poll_s: float = POLL_S) -> int:
    """Poll until every run is done, failed or gone from the queue; one line per state change.
    0 = all done, 1 = not."""
    gone: Dict[str, int] = defaultdict(int)
    while True:
        jobs = [read_state(r.run_dir).get("job") for r in runs]
        queue = squeue_states([j for j in jobs if j])
        active = 0
        for run in runs:
            status = run_status(run.run_dir, train_iters[run.name], queue)
            if status.state == "interrupted":  # out of the queue unfinished: sure after two polls in a row
                gone[run.name] += 1
                if gone[run.name] < 2:
                    active += 1
                    continue
            else:
                gone[run.name] = 0
            announce(run.index, run.name, status.state, status.detail if status.state != "running" else "")
            active += status.state in ("pending", "running")
        if not active:
            return 0 if all(read_complete_marker(r.run_dir) is not None for r in runs) else 1
        time.sleep(poll_s)


def run_slurm(spec: SweepSpec, runs: Sequence[Run], train_iters: Dict[str, int], announce: Announcer,
              no_wait: bool = False, poll_s: float = POLL_S) -> int:
    """Submit the unfinished `runs` whose job is not in the queue any more (or never was), then
    (unless `no_wait`) wait for all of them."""
    jobs = {r.name: read_state(r.run_dir).get("job") for r in runs}
    queue = squeue_states([j for j in jobs.values() if j])
    if queue is None:
        raise ConfigError("squeue did not answer: cannot tell which runs are still queued (try again)")
    queued = [r for r in runs if jobs[r.name] in queue]
    for r in queued:
        print(f"  {r.name}: still in the queue as job {jobs[r.name]} (not submitted again)")
    todo = [r for r in runs if r not in queued]
    if todo:
        submit(spec, todo)
    return 0 if no_wait else wait(runs, train_iters, announce, poll_s)
