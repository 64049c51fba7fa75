"""scripts/run_local.sh NPROC CONFIG [overrides]: torchrun on this machine, overrides passed through."""
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "run_local.sh"


def test_run_local_trains_on_2_ranks(tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("OMP_NUM_THREADS", None)  # the script's default (1) applies
    proc = subprocess.run([str(SCRIPT), "2", "configs/gpt_moe_tiny.yaml", "training.train_iters=2",
                           "training.log_interval=1", "training.eval_interval=0", "model.seq_length=32",
                           "parallel.expert=2", f"training.run_dir={run_dir}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in records)
    # expert=2 needs 2 ranks: tokens crossed between them
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["parallel"]["expert"] == 2
    assert all(r["comm_bytes"].get("all_to_all", 0) > 0 for r in records)


@pytest.mark.parametrize("args", [[], ["configs/gpt_moe_tiny.yaml"], ["two", "configs/gpt_moe_tiny.yaml"]])
def test_run_local_usage_errors(args):
    proc = subprocess.run([str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "usage:" in proc.stderr and "NPROC CONFIG" in proc.stderr


@pytest.mark.parametrize("nproc,override,needle", [
    ("2", "parallel.expert=3", "parallel.expert=3 does not divide moe.num_experts=8"),
    ("3", "parallel.expert=2", "does not divide the 3 ranks"),  # checked with the launch's world size
    ("4", "parallel.pipeline=3", "world size 4 is not divisible by parallel.tensor*parallel.pipeline=1*3"),
], ids=["expert3", "world3", "pipeline3"])
def test_run_local_config_error_once_before_any_worker(nproc, override, needle):
    """The script validates the config once (`--check-config --world-size NPROC`) and never starts
    torchrun: one line, exit 2, no torchrun failure report."""
    start = time.monotonic()
    proc = subprocess.run([str(SCRIPT), nproc, "configs/gpt_moe_tiny.yaml", override], cwd=ROOT,
                          env=dict(os.environ, PYTHON=sys.executable), capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    errors = [line for line in out.splitlines() if "config error:" in line]
    assert len(errors) == 1 and errors[0].startswith("config error:") and needle in errors[0], out[-3000:]
    assert "Traceback" not in out and "ChildFailedError" not in out
    assert elapsed < 30, f"{elapsed:.1f} s: workers were started?"
