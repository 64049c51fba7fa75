"""A clean stop of a local sweep leaves a clean log (issue #43 item 12): SIGTERM to `tools/sweep.py
run` mid-run stops the run at an iteration boundary with a checkpoint: the run's launcher exits 0 (its
recorded exit code), the sweep tool exits 130 (it was stopped), and the run's sweep.log ends with the stop line, without torchrun's `SignalException` traceback."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_a_stopped_local_sweep_logs_no_traceback(tmp_path):
    body = {"base": "configs/gpt_moe_tiny.yaml", "sweep_dir": str(tmp_path / "sweep"),
            "overrides": ["model.seq_length=32", "training.log_interval=1", "training.train_iters=500",
                          "training.eval_interval=0", "logging.tensorboard=false"],
            "launch": {"backend": "local", "nproc": 1}}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(body))
    run_dir = tmp_path / "sweep" / "runs" / "run"
    proc = subprocess.Popen([sys.executable, "tools/sweep.py", "run", str(tmp_path / "s.yaml")], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 130, out
    assert "[1/1] run: running -> interrupted (stopped by the sweep; `run` resumes it)" in out, out
    log = (run_dir / "sweep.log").read_text()
    last = log.rstrip("\n").splitlines()[-1]
    assert last.startswith("SIGTERM: stopped after iteration ") and "checkpoint saved to" in last, log
    assert "Traceback" not in log and "SignalException" not in log, log
    state = json.loads((run_dir / "sweep_state.json").read_text())
    assert state["state"] == "stopped" and state["exit_code"] == 0, state
