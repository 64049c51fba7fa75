"""Failure behaviour of the training loop (docs/running.md, "Preemption and failures").

* Preemption / time limit: SIGTERM or SIGUSR1 (SLURM's `--signal=USR1@180` warning) on any rank
  sets a flag; after every iteration all ranks all-reduce (max) their flags over `world`
  (`COMM_STATS` kind "stop_flag", 4 bytes), so they all stop after the same iteration, save a
  checkpoint and exit 0. SIGINT (Ctrl-C) does the same; a second SIGINT aborts at once without
  saving: one line, exit 130 (`INTERRUPT_EXIT`). Under the sbatch scripts, which name a file in
  `MEGATRON_MOE_REQUEUE_FILE`, rank 0 then writes the checkpoint's path there when the same
  command resumes from it (`checkpoint.load: auto`, iterations left): the job script requeues the
  job (`request_requeue`).
* Non-finite loss or gradient: the global grad norm and the loss are identical on every rank, so
  every rank takes the same decision without communication: `training.on_nonfinite: skip` drops
  the update and counts it, `stop` raises `NonFiniteError` (exit code 3 from the entry point).
* An unusable checkpoint (missing, incomplete, corrupt, not matching the model) raises
  `CheckpointError` (defined here, not in `checkpoint_io.py`, so that the entry point can catch it
  without importing torch.distributed.checkpoint, ~1 s per process, before it is needed).
* A dead rank is the launcher's business (torchrun's monitor, `srun --kill-on-bad-exit`): it
  ends the others and names the failed rank; gloo peers also fail fast on the closed connection,
  and `parallel.timeout_s` bounds a collective that never completes.
"""
from __future__ import annotations

import math
import os
import signal
import threading
from typing import Optional, Sequence

import torch

from megatron_moe.distributed import collectives
from megatron_moe.distributed.parallel_state import ParallelState


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: incomplete, corrupt, unsafe, or not matching the model."""


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # repeats are ignored once stopping
CONFIG_ERROR_EXIT = 2  # a config (or checkpoint) error: one line `config error: ...`
NONFINITE_EXIT = 3
INTERRUPT_EXIT = 130  # 128 + SIGINT, as a shell reports a process ended by Ctrl-C
REQUEUE_FILE_ENV = "MEGATRON_MOE_REQUEUE_FILE"  # set by scripts/slurm/srun_pretrain.sh


class NonFiniteError(RuntimeError):
    """A NaN/Inf loss or gradient with `training.on_nonfinite: stop`."""


def abort_on_interrupt(rank: int = 0) -> None:
    """A second Ctrl-C: end the process at once (no save, no teardown), one line from rank 0."""
    if rank == 0:
        os.write(2, b"SIGINT again: aborted at once, nothing saved (resume from the last checkpoint)\n")
    os._exit(INTERRUPT_EXIT)


class StopRequest:
    """Records SIGTERM/SIGUSR1/SIGINT while installed (a context manager; old handlers come back on
    exit, unless the ranks stopped on a stop signal: then the process is on its way out and ignores
    further SIGTERM/SIGUSR1, so that a repeat cannot kill it while it tears down, while a second
    SIGINT aborts it at once, as one during the rest of the iteration or the save does
    (`abort_on_interrupt`: Ctrl-C twice means now). Slurm's `scancel --signal` on one task of a
    job array whose other tasks are pending delivers the signal again every few seconds, and a
    time limit's SIGTERM follows its warning. SIG_IGN, not a Python handler:
    Python's finalization restores the default action, which kills, for signals with a Python
    handler).
    Python delivers signals to the main thread only: elsewhere (a trainer driven from a worker
    thread) no handler is installed and only other ranks' flags count."""

    def __init__(self, state: ParallelState, device: torch.device):
        self.state, self.device = state, device
        self.signal_name = None
        self.stopping = False  # a stop signal reached some rank (`agreed`) or this one
        self._previous = {}

    def _rank(self) -> int:
        return self.state.rank if self.state is not None else 0

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and (self.stopping or self.signal_name is not None):
            abort_on_interrupt(self._rank())
        self.signal_name = signal.Signals(signum).name

    def _abort(self, signum, frame) -> None:
        abort_on_interrupt(self._rank())

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in STOP_SIGNALS + (signal.SIGINT,):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        stopping = self.stopping or self.signal_name is not None
        for sig, handler in self._previous.items():
            if stopping:
                handler = self._abort if sig == signal.SIGINT else signal.SIG_IGN
            signal.signal(sig, handler)

    def agreed(self) -> bool:
        """True on every rank iff a stop signal reached any rank (collective over `world`)."""
        flag = torch.tensor([int(self.signal_name is not None)], dtype=torch.int32, device=self.device)
        self.stopping = bool(collectives.all_reduce(flag, self.state.world, op="max", kind="stop_flag").item())
        return self.stopping


def all_finite(values: Sequence[float]) -> bool:
    return all(math.isfinite(v) for v in values)


def request_requeue(checkpoint: Optional[str], load: Optional[str], iterations_left: int,
                    env=os.environ) -> Optional[str]:
    """Rank 0, after a stop signal saved `checkpoint`: ask the job script to requeue the job by
    writing the checkpoint's path to the file `MEGATRON_MOE_REQUEUE_FILE` names, if the requeued
    job, the same command, resumes from it (`checkpoint.load` = `load` is auto) and has iterations
    left. Returns what happens, for the stop message (None outside such a job script)."""
    path = env.get(REQUEUE_FILE_ENV)
    if not path or checkpoint is None or iterations_left <= 0:
        return None
    if load != "auto":
        return "the job is not requeued (a requeued job resumes only with checkpoint.load=auto)"
    with open(path + ".tmp", "w") as f:
        f.write(checkpoint + "\n")
    os.replace(path + ".tmp", path)
    return "the job script requeues the job, which resumes from it (checkpoint.load=auto)"
