"""The completion marker `<run_dir>/complete.json`: written by rank 0 when training reaches
`training.train_iters` (not when a stop signal, an error or a non-finite stop ends it), removed
when a run starts training in that directory. The sweep tool (docs/sweeps.md) skips runs that have
it and resumes the others from their last checkpoint.

    {"train_iters": 50, "finished": "2026-11-30T12:00:00"}

No torch import: `tools/sweep.py status` reads it without loading the training stack.
"""
from __future__ import annotations

import datetime
import json
import os
from typing import Optional

COMPLETE_MARKER = "complete.json"


def clear_complete_marker(run_dir: str) -> None:
    try:
        os.remove(os.path.join(run_dir, COMPLETE_MARKER))
    except FileNotFoundError:
        pass


def write_complete_marker(run_dir: str, train_iters: int) -> None:
    """Atomically (write + rename): a reader never sees half a marker."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, COMPLETE_MARKER)
    with open(path + ".tmp", "w") as f:
        json.dump({"train_iters": train_iters,
                   "finished": datetime.datetime.now().isoformat(timespec="seconds")}, f)
    os.replace(path + ".tmp", path)


def read_complete_marker(run_dir: str) -> Optional[dict]:
    """The marker's content, or None when the run has not finished."""
    try:
        with open(os.path.join(run_dir, COMPLETE_MARKER)) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None
