"""torchrun on this machine for scripts/run_local.sh, with the exit status and output that the
workers' own outcomes call for (docs/running.md):

    python -m megatron_moe.training.run_local NPROC ENTRY [ENTRY's arguments ...]
    = torchrun --standalone --nproc_per_node NPROC ENTRY ..., in this process (`torch.distributed.run.run`)

* Ctrl-C (SIGINT) or SIGTERM to this launcher goes to every worker (each runs in a session of
  its own, so a terminal's Ctrl-C reaches only the launcher); the workers finish the iteration,
  save and exit 0 (training/failures.py), and so does the launcher. torchrun's own handling would
  give them 30 s before SIGKILL and exit 1 with a `SignalException` traceback. A second Ctrl-C
  makes the workers abort at once; the launcher exits 130.
* A worker's config error (exit code 2 after rank 0's one line `config error: ...`, e.g. a
  checkpoint found corrupt while loading): exit 2, without torchrun's `ChildFailedError` report.
* Any other failure: torchrun's summary of the failed ranks (root cause first), exit 1.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from typing import List, Optional

from megatron_moe.training.failures import CONFIG_ERROR_EXIT, INTERRUPT_EXIT

FORWARDED = (signal.SIGINT, signal.SIGTERM)


def worker_pids(parent: int) -> List[int]:
    """The processes torchrun's agent (`parent`) started as workers: its children with LOCAL_RANK set."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) != parent:
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        if any(item.startswith(b"LOCAL_RANK=") for item in environ):
            out.append(int(pid))
    return out


class Forwarder:
    """The launcher's SIGINT / SIGTERM handler: pass the signal on to the workers."""

    def __init__(self):
        self.received = 0

    def __call__(self, signum, frame) -> None:
        self.received += 1
        pids = worker_pids(os.getpid())
        if not pids:  # before the workers start (rendezvous): nothing to stop cleanly
            print(f"{signal.Signals(signum).name}: no worker running yet; stopped", file=sys.stderr, flush=True)
            os._exit(INTERRUPT_EXIT)
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or not argv[0].isdigit():
        print("usage: python -m megatron_moe.training.run_local NPROC ENTRY [arguments ...]", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.disable(logging.CRITICAL)  # the agent's log lines; a real failure's summary is printed below
    forward = Forwarder()
    for sig in FORWARDED:
        signal.signal(sig, forward)
    try:
        run(parse_args(["--standalone", f"--nproc_per_node={argv[0]}",
                        "--signals_to_handle=SIGHUP,SIGQUIT", *argv[1:]]))  # SIGINT, SIGTERM: `Forwarder`
    except ChildFailedError as exc:
        _, first = exc.get_first_failure()
        if first.exitcode in (CONFIG_ERROR_EXIT, INTERRUPT_EXIT):  # the worker's one line said why
            return first.exitcode
        print(exc.format_msg(), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
