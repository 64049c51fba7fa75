"""Each run's state on disk: what `run` skips or resumes and what `status` shows (docs/sweeps.md).

In a run directory (`<sweep_dir>/runs/<name>/`):

    complete.json      the trainer's completion marker (training/completion.py): the run is done
    sweep_state.json   the launcher's record: {"state": running | stopped | failed | submitted |
                       requeued, "backend", "pid" or "job", "overrides", "error", "attempt", ...}
    sweep.log          the run's console output, every attempt appended after a header line
    .sweep.lock        flock-ed while a local run is alive (by the sweep and the run's torchrun,
                       which inherits it, so it frees itself when both are gone, `kill -9` included)
    metrics.jsonl      the trainer's metrics: iteration reached, ETA

`status` folds these into one of STATES.
"""
from __future__ import annotations

import datetime
import fcntl
import json
import os
import re
import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from megatron_moe.training.completion import read_complete_marker

STATES = ("pending", "running", "done", "failed", "interrupted")
STATE_FILE, LOG_FILE, LOCK_FILE, METRICS_FILE = "sweep_state.json", "sweep.log", ".sweep.lock", "metrics.jsonl"


def now() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")


def read_state(run_dir: str) -> Dict:
    try:
        with open(os.path.join(run_dir, STATE_FILE)) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def write_state(run_dir: str, **fields) -> Dict:
    """Merge `fields` into the run's state file (atomically) and return it."""
    state = {**read_state(run_dir), **fields, "updated": now()}
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, STATE_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(state, f, indent=1)
    os.replace(path + ".tmp", path)
    return state


def read_records(run_dir: str) -> List[Dict]:
    """metrics.jsonl, one record per iteration (a repeated iteration: its last record), in order."""
    by_iteration: Dict[int, Dict] = {}
    try:
        with open(os.path.join(run_dir, METRICS_FILE)) as f:
            for line in f:
                if line.strip():
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError:  # a line cut short by a kill
                        continue
                    by_iteration[record["iteration"]] = record
    except FileNotFoundError:
        pass
    return [by_iteration[i] for i in sorted(by_iteration)]


class RunLock:
    """An exclusive flock on `<run_dir>/.sweep.lock`; `fd` is passed to the run's launcher."""

    def __init__(self, run_dir: str):
        os.makedirs(run_dir, exist_ok=True)
        self.fd: Optional[int] = os.open(os.path.join(run_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)

    def acquire(self) -> bool:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            self.release()
            return False

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def is_locked(run_dir: str) -> bool:
    if not os.path.exists(os.path.join(run_dir, LOCK_FILE)):
        return False
    lock = RunLock(run_dir)
    free = lock.acquire()
    lock.release()
    return not free


def error_line(text: str) -> str:
    """The line that says why a run failed: the config error or stop line, else the first Python
    exception line (not the launchers' own ChildFailedError summaries), else the last line."""
    lines = [re.sub(r"^(\[rank\d+\]:|\d+:)\s*", "", line).strip() for line in text.splitlines()]
    lines = [line for line in lines if line]
    for line in lines:
        if line.startswith(("config error:", "stopped:")):
            return line
    for line in lines:
        if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b:?", line) and "ChildFailedError" not in line:
            return line
    return lines[-1] if lines else "(no output)"


def log_since(run_dir: str, offset: int) -> str:
    try:
        with open(os.path.join(run_dir, LOG_FILE), errors="replace") as f:
            f.seek(offset)
            return f.read()
    except FileNotFoundError:
        return ""


@dataclass
class RunStatus:
    state: str  # one of STATES
    iteration: int = 0  # the last iteration in metrics.jsonl
    eta_s: Optional[float] = None
    detail: str = ""


def progress(run_dir: str, train_iters: int) -> Tuple[int, Optional[float]]:
    """(iteration reached, seconds left at the recent pace) from metrics.jsonl."""
    records = read_records(run_dir)
    if not records:
        return 0, None
    recent = [r["iter_time_ms"] for r in records[-5:] if "iter_time_ms" in r]
    last = records[-1]["iteration"]
    eta = (train_iters - last) * statistics.median(recent) / 1e3 if recent else None
    return last, eta


def run_status(run_dir: str, train_iters: int, queue: Optional[Dict[str, Tuple[str, str]]] = None) -> RunStatus:
    """Fold the files above (and, for SLURM runs, `queue`: job id -> (state, reason) from squeue,
    None when squeue could not be asked) into a RunStatus."""
    iteration, eta = progress(run_dir, train_iters)
    if read_complete_marker(run_dir) is not None:
        return RunStatus("done", iteration)
    st = read_state(run_dir)
    state, job = st.get("state"), st.get("job")
    if state == "failed":
        return RunStatus("failed", iteration, detail=st.get("error", ""))
    if st.get("backend") == "local" and state == "running":
        if is_locked(run_dir):
            return RunStatus("running", iteration, eta, f"pid {st.get('pid')}")
        return RunStatus("interrupted", iteration, detail="its launcher is gone; `run` resumes it")
    if st.get("backend") == "slurm" and state in ("submitted", "running", "requeued"):
        if queue is None:
            return RunStatus("running" if state == "running" else "pending", iteration, eta,
                             f"job {job} (squeue unavailable)")
        if job in queue:
            slurm_state, reason = queue[job]
            restarts = f", requeued {st['restarts']}x" if st.get("restarts") else ""
            if slurm_state in ("RUNNING", "COMPLETING", "CONFIGURING"):
                return RunStatus("running", iteration, eta, f"job {job}{restarts}")
            return RunStatus("pending", iteration, detail=f"job {job} {slurm_state.lower()} ({reason}){restarts}")
        return RunStatus("interrupted", iteration, detail=f"job {job} left the queue unfinished; `run` resumes it")
    if state == "stopped" and st.get("job_state"):
        return RunStatus("interrupted", iteration, detail=f"job {job} ended ({st['job_state']}); `run` resumes it")
    if state == "stopped" or iteration > 0:
        return RunStatus("interrupted", iteration, detail="stopped before the end; `run` resumes it")
    return RunStatus("pending", iteration)


def format_eta(seconds: Optional[float]) -> str:
    return "-" if seconds is None else str(datetime.timedelta(seconds=round(seconds)))


def status_table(rows: List[Tuple[int, str, int, RunStatus]]) -> str:
    """rows: (index, name, train_iters, status) -> the `status` table, then counts per state."""
    width = max([len(name) for _, name, _, _ in rows] + [3])
    lines = [f"{'#':>3}  {'run':<{width}}  {'state':<11}  {'iteration':>11}  {'ETA':>8}  detail"]
    for index, name, train_iters, s in rows:
        lines.append(f"{index:>3}  {name:<{width}}  {s.state:<11}  {f'{s.iteration}/{train_iters}':>11}  "
                     f"{format_eta(s.eta_s) if s.state == 'running' else '-':>8}  {s.detail}".rstrip())
    counts = {state: sum(s.state == state for *_, s in rows) for state in STATES}
    lines.append(", ".join(f"{n} {state}" for state, n in counts.items() if n) + f" (of {len(rows)})")
    return "\n".join(lines)


class Announcer:
    """One line per run state change: `[12:00:01] [2/8] balancer=none,seed=1: pending -> running (pid 4242)`."""

    def __init__(self, total: int):
        self.total = total
        self.last: Dict[str, str] = {}

    def __call__(self, index: int, name: str, state: str, detail: str = "") -> None:
        """Print the change to `state` (nothing if the run is in it already)."""
        old = self.last.get(name, "pending")
        if old == state:
            return
        self.last[name] = state
        clock = datetime.datetime.now().strftime("%H:%M:%S")
        print(f"[{clock}] [{index}/{self.total}] {name}: {old} -> {state}" + (f" ({detail})" if detail else ""),
              flush=True)
