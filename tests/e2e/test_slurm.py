"""The sbatch scripts on a real one-node SLURM cluster (tests/e2e/slurm_cluster.py,
started once by the `slurm_env` fixture of tests/e2e/conftest.py).

`sbatch --wait -N1 -n4 scripts/slurm/pretrain_gpt_moe.sbatch --config ... overrides` trains 4 gloo
ranks started by srun; the job's log and the run's metrics.jsonl are checked. Skips (saying why)
only where slurm-wlm/munge are not installed or we are not root, and fails there under CI=true;
.ci/run installs them.
The config check before srun runs everywhere: the job body with a stand-in `srun` on PATH.
"""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml


pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
TINY = ["training.train_iters=3", "training.log_interval=1", "training.eval_interval=0", "model.seq_length=32",
        "parallel.expert=2"]


def sbatch(env, log_dir: Path, args, timeout=240):
    """Submit from the repository root (as documented) with the log redirected to `log_dir`;
    return (exit code, log text)."""
    proc = subprocess.run(["sbatch", "--wait", f"--output={log_dir}/%x-%j.log"] + args, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    job = re.search(r"Submitted batch job (\d+)", proc.stdout)
    assert job, proc.stdout + proc.stderr
    logs = list(log_dir.glob(f"*-{job.group(1)}.log"))
    assert len(logs) == 1, (proc.stdout, proc.stderr, logs)
    return proc.returncode, logs[0].read_text()


def test_sbatch_trains_gpt_moe_on_4_gloo_ranks(slurm_env, tmp_path):
    run_dir = tmp_path / "run"
    code, log = sbatch(slurm_env, tmp_path, ["-N1", "-n4", "scripts/slurm/pretrain_gpt_moe.sbatch",
                                             "--config", "configs/gpt_moe_tiny.yaml", *TINY,
                                             f"training.run_dir={run_dir}"])
    assert code == 0, log
    assert re.search(r"job \d+ \(gpt_moe\): 4 tasks on \S+, master \S+:\d+", log), log
    assert "finished with exit code 0" in log, log
    assert (run_dir / "metrics.jsonl").exists(), log
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and 0 < r["loss"] < 20 for r in records), records
    # the overrides reached every rank: expert parallelism over 2 of the 4 ranks moved tokens
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["parallel"]["expert"] == 2
    assert all(r["comm_bytes"].get("all_to_all", 0) > 0 for r in records), records


def test_sbatch_rejects_bad_arguments_before_starting_ranks(slurm_env, tmp_path):
    code, log = sbatch(slurm_env, tmp_path, ["-n1", "scripts/slurm/pretrain_bert_moe.sbatch", "model.num_layers=2"])
    assert code == 2 and "usage: sbatch [sbatch options] scripts/slurm/pretrain_bert_moe.sbatch --config FILE" in log, log
    code, log = sbatch(slurm_env, tmp_path, ["-n1", "scripts/slurm/pretrain_bert_moe.sbatch",
                                             "--config", "configs/missing.yaml"])
    assert code == 2 and "config file not found: configs/missing.yaml" in log, log


@pytest.mark.parametrize("ntasks,entry,code", [("3", "pretrain_gpt_moe.py", 2), ("2", "pretrain_bert_moe.py", 0)])
def test_job_checks_config_once_with_slurm_ntasks_before_srun(tmp_path, ntasks, entry, code):
    """srun_pretrain.sh (the sbatch scripts' body) without SLURM: `parallel.expert=2` on SLURM_NTASKS=3
    is one config error, exit 2, and srun never runs; on 2 tasks srun starts ENTRY with the arguments."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text('#!/bin/sh\necho "$@" > "$SRUN_ARGS"\n')
    (fake / "srun").chmod(0o755)
    env = dict(os.environ, PYTHON=sys.executable, PATH=f"{fake}:{os.environ['PATH']}", SRUN_ARGS=str(tmp_path / "args"),
               SLURM_JOB_ID="77", SLURM_JOB_NAME="job", SLURM_NTASKS=ntasks, SLURM_JOB_NODELIST="localhost")
    config = "configs/gpt_moe_tiny.yaml" if entry == "pretrain_gpt_moe.py" else "configs/bert_moe_tiny.yaml"
    proc = subprocess.run(["bash", "scripts/slurm/srun_pretrain.sh", entry, "--config", config, "parallel.expert=2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == code, out
    assert "Traceback" not in out
    if code:
        errors = [line for line in out.splitlines() if "config error:" in line]
        assert errors == ["config error: parallel.expert*parallel.expert_shard=2*1 does not divide the 3 ranks of "
                          "a pipeline stage (world size 3 / parallel.pipeline)"], out
        assert not (tmp_path / "args").exists(), "srun was started"
    else:
        assert (tmp_path / "args").read_text().split() == [
            "--kill-on-bad-exit=1", "--label", sys.executable, "-u", f"{ROOT}/{entry}", "--config", config,
            "parallel.expert=2"]
