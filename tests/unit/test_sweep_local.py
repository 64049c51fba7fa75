"""The local queue (megatron_moe/sweep/local.py) with stand-in launches (shell one-liners instead
of torchrun): `max_parallel` at a time, a failed run recorded with its error line while the others
go on, the run lock, `status`; and the error line picked from real launcher output (state.py)."""
import json
import os

import yaml

from megatron_moe.sweep.local import LocalQueue
from megatron_moe.sweep.spec import expand, load_sweep
from megatron_moe.sweep.state import Announcer, RunLock, error_line, read_state, run_status, status_table

TINY = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "gpt_moe_tiny.yaml")
TRACEBACK = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "pretrain_gpt_moe.py", line 14, in <module>
[rank0]: ValueError: boom in rank 0
E1125 04:00:00 torch/distributed/elastic/multiprocessing/api.py: failed (exitcode: 1)
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
"""


def test_error_line_picks_the_cause():
    assert error_line(TRACEBACK) == "ValueError: boom in rank 0"
    assert error_line("iter 1\nconfig error: moe.top_k=9 exceeds moe.num_experts=8\nChildFailedError:\n") == \
        "config error: moe.top_k=9 exceeds moe.num_experts=8"
    assert error_line("0: iter 2\n1: RuntimeError: Connection closed by peer\nsrun: error: task 1: Exited\n") == \
        "RuntimeError: Connection closed by peer"
    assert error_line("some output\nKilled\n") == "Killed" and error_line("") == "(no output)"


def test_queue_runs_max_parallel_records_a_failure_and_goes_on(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"base": TINY, "grid": {"training.seed": [1, 2, 3]},
                                    "launch": {"nproc": 1, "max_parallel": 2}, "sweep_dir": str(tmp_path / "sw")}))
    spec = load_sweep(str(path))
    runs = expand(spec)
    queue = LocalQueue(spec, runs, Announcer(len(runs)))
    peak, live = tmp_path / "peak", tmp_path / "live"
    live.mkdir()

    def command(run):  # seed 2 fails like a crashed rank; the others finish (marker written)
        body = f"echo '{TRACEBACK}'; exit 1" if run.name == "seed=2" else \
            f"echo '{{\"train_iters\": 1}}' > '{run.run_dir}/complete.json'"
        return ["bash", "-c", f"touch {live}/{run.index}; ls {live} | wc -l >> {peak}; sleep 1; rm {live}/{run.index}; "
                              + body]

    queue.command = command
    assert queue.run() == 1  # one failed
    out = capsys.readouterr().out
    for name in ("seed=1", "seed=3"):
        assert f"{name}: running -> done" in out
    assert "[2/3] seed=2: running -> failed (exit code 1: ValueError: boom in rank 0)" in out
    state = read_state(runs[1].run_dir)
    assert state["state"] == "failed" and state["error"] == "exit code 1: ValueError: boom in rank 0"
    assert state["overrides"] == runs[1].overrides
    assert max(int(x) for x in peak.read_text().split()) == 2  # two at once, the third after one ended
    rows = [(r.index, r.name, 1, run_status(r.run_dir, 1)) for r in runs]
    assert [s.state for *_, s in rows] == ["done", "failed", "done"]
    assert "2 done, 1 failed (of 3)" in status_table(rows)


def test_a_run_whose_lock_is_held_is_left_alone(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"base": TINY, "sweep_dir": str(tmp_path / "sw")}))
    spec = load_sweep(str(path))
    (run,) = expand(spec)
    held = RunLock(run.run_dir)
    assert held.acquire()  # another sweep process runs it
    try:
        queue = LocalQueue(spec, [run], Announcer(1))
        queue.command = lambda r: ["bash", "-c", "exit 7"]
        assert queue.run() == 0
        assert "already running under another sweep process: left alone" in capsys.readouterr().out
        assert read_state(run.run_dir) == {}  # nothing launched, nothing recorded
    finally:
        held.release()
    with open(os.path.join(run.run_dir, "sweep_state.json"), "w") as f:
        json.dump({"state": "running", "backend": "local", "pid": 1}, f)
    assert run_status(run.run_dir, 1).state == "interrupted"  # lock free: its launcher is gone
