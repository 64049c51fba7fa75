"""tools/profile_comm.py writes a profile that `moe.schedule: auto` reads; benchmarks/moe_layer.py
prints its JSON (Parm §V-A, issue 6). Small sizes: this checks the plumbing, not the speed."""
import json
import os
import subprocess
import sys

import pytest

from megatron_moe.config import load_config, validate_config
from megatron_moe.perf.hardware import load_profile

pytestmark = pytest.mark.e2e
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def torchrun(nproc, *args, timeout=240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_profile_comm_writes_a_profile_that_auto_reads(tmp_path):
    out = tmp_path / "profile.yaml"
    torchrun(4, "tools/profile_comm.py", "--tensor", "2", "--expert", "2", "--min-elements", "1024",
             "--max-elements", "16384", "--points", "3", "--reps", "2", "--out", str(out))
    profile = load_profile(str(out))
    for op in (profile.mp_allgather, profile.ep_esp_alltoall, profile.saa):
        # least-squares fit with its quality recorded; costs are non-negative and grow with size
        assert op.alpha >= 0 and op.beta >= 0 and op.r2 is not None and op.r2 <= 1.0
    cfg = load_config("configs/gpt_moe_tiny.yaml", ["moe.schedule=auto", f"perf.hardware_profile={out}",
                                                    "parallel.tensor=2", "parallel.expert=2"])
    validate_config(cfg, 4)


def test_benchmark_prints_every_schedule(tmp_path):
    stdout = torchrun(4, "benchmarks/moe_layer.py", "--tensor", "2", "--expert", "2", "--reps", "1",
                      "--warmup", "0", "--batch", "1", "--seq", "16", "--hidden", "32", "--ffn", "64")
    result = json.loads(stdout.strip().splitlines()[-1])
    assert {"baseline", "s1", "s2", "s2_saa", "auto"} <= result["results"].keys()
    for name, row in result["results"].items():
        assert row["ms_median"] > 0 and row["speedup_vs_baseline"] > 0, name
    # s1/s2 move no ESP/EP-only traffic: their all-to-all runs on ep_esp
    assert "all_to_all/ep_esp" in result["results"]["s1"]["bytes"]
    assert "all_to_all/ep" in result["results"]["baseline"]["bytes"]
