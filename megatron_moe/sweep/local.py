"""The local backend: a queue that runs up to `launch.max_parallel` runs at once on this machine,
each through `scripts/run_local.sh NPROC BASE overrides...` (torchrun, the same command a user types).

Each launch runs in its own session (a Ctrl-C in the terminal reaches the sweep only), dies with the
sweep (PR_SET_PDEATHSIG: SIGTERM, which torchrun forwards to its workers, which save and stop) and
holds the run's lock (state.py) for as long as it lives. SIGINT / SIGTERM to the sweep: no new
launches, SIGTERM to the running ones (each finishes its iteration, saves a checkpoint and stops),
wait for them; a second signal kills them.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, List, TextIO

from megatron_moe.sweep.spec import ROOT, Run, SweepSpec, shown
from megatron_moe.sweep.state import LOG_FILE, Announcer, RunLock, error_line, log_since, now, write_state
from megatron_moe.training.completion import read_complete_marker

POLL_S = 0.5


def _die_with_parent() -> None:
    """In the launch's process, before exec: SIGTERM when the sweep process dies, even by SIGKILL
    (Linux; elsewhere a launch outlives a killed sweep, and its lock keeps a rerun off it)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Launched:
    run: Run
    proc: subprocess.Popen
    lock: RunLock
    log: TextIO
    log_offset: int


class LocalQueue:
    def __init__(self, spec: SweepSpec, runs: List[Run], announce: Announcer):
        self.spec, self.announce = spec, announce
        self.queue: Deque[Run] = deque(runs)
        self.running: Dict[str, Launched] = {}
        self.stopping = 0  # signals received
        self.failed: List[str] = []
        self.max_parallel = runs[0].launch.max_parallel if runs else 1  # a sweep-wide key

    def command(self, run: Run) -> List[str]:
        return ["bash", str(ROOT / "scripts" / "run_local.sh"), str(run.launch.world_size), self.spec.base,
                *run.overrides]

    def start(self, run: Run) -> None:
        lock = RunLock(run.run_dir)
        if not lock.acquire():
            self.announce(run.index, run.name, "running", "already running under another sweep process: left alone")
            return
        log = open(os.path.join(run.run_dir, LOG_FILE), "a")
        offset = log.tell()
        cmd = self.command(run)
        log.write(f"===== {now()} sweep launch: ENTRY={self.spec.entry} {' '.join(cmd)}\n")
        log.flush()
        env = dict(os.environ, ENTRY=self.spec.entry, PYTHON=sys.executable)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                pass_fds=(lock.fd,), preexec_fn=_die_with_parent)
        self.running[run.name] = Launched(run, proc, lock, log, offset)
        write_state(run.run_dir, state="running", backend="local", pid=proc.pid, started=now(),
                    overrides=run.overrides, error=None)
        self.announce(run.index, run.name, "running", f"pid {proc.pid}, log {shown(run.run_dir)}/{LOG_FILE}")

    def finish(self, job: Launched) -> None:
        code = job.proc.returncode
        job.log.close()
        job.lock.release()
        del self.running[job.run.name]
        run = job.run
        if read_complete_marker(run.run_dir) is not None:
            write_state(run.run_dir, state="done", exit_code=code)
            self.announce(run.index, run.name, "done")
        elif self.stopping:
            write_state(run.run_dir, state="stopped", exit_code=code)
            self.announce(run.index, run.name, "interrupted", "stopped by the sweep; `run` resumes it")
        else:
            error = f"exit code {code}: {error_line(log_since(run.run_dir, job.log_offset))}"
            write_state(run.run_dir, state="failed", exit_code=code, error=error)
            self.failed.append(run.name)
            self.announce(run.index, run.name, "failed", error)

    def _signal(self, signum, frame) -> None:
        self.stopping += 1
        sig = signal.SIGTERM if self.stopping == 1 else signal.SIGKILL
        print(f"sweep: {signal.Signals(signum).name}: no new runs; {sig.name} to the {len(self.running)} running "
              f"({'each saves a checkpoint and stops; again to kill' if sig == signal.SIGTERM else 'killed'})",
              flush=True)
        for job in self.running.values():
            try:
                os.killpg(job.proc.pid, sig)
            except ProcessLookupError:
                pass

    def run(self) -> int:
        """Run the queue to its end: 0 = every run done, 1 = some failed, 130 = stopped by a signal."""
        previous = {s: signal.signal(s, self._signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            while self.queue or self.running:
                while self.queue and len(self.running) < self.max_parallel and not self.stopping:
                    self.start(self.queue.popleft())
                for job in list(self.running.values()):
                    if job.proc.poll() is not None:
                        self.finish(job)
                if self.stopping and not self.running:
                    break
                time.sleep(POLL_S)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        return 130 if self.stopping else (1 if self.failed else 0)


def run_local(spec: SweepSpec, runs: List[Run], announce: Announcer) -> int:
    return LocalQueue(spec, runs, announce).run()
