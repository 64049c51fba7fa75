"""The throughput smoke run of `make test-gpu` (issue #44): benchmarks/train_throughput.py in bf16 on
one GPU prints tokens/s and MFU (model FLOPs utilization) per side in its JSON. The CPU variant
runs the same code path at a tiny shape with `--peak-tflops` (the CPU has no peak in the table),
so `make test` keeps the JSON's MFU fields working where no GPU is.

Asserted: tokens/s > 0 and 0 < MFU < 1 for every side, MFU = FLOPs per token x tokens/s / peak,
FLOPs per token = 6 x active GEMM weights + the attention term (6 L s h_q), active weights below the
parameter count (top-2 of 8 experts), the same first-step loss on every side to bf16 rounding,
and the loss of an untrained model (~ln 1024)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
BENCH = [sys.executable, "benchmarks/train_throughput.py", "--precision", "bf16", "--no-compile"]
RUNS = {  # device: extra arguments (the CPU: a tiny shape, one step; the GPU: the benchmark's shape)
    "cpu": ["--device", "cpu", "model.num_layers=1", "model.seq_length=32", "training.micro_batch_size=2",
            "--steps", "1", "--warmup", "0", "--peak-tflops", "1"],
    "cuda": ["--device", "cuda", "--steps", "5", "--warmup", "3"],
}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_throughput_smoke_prints_tokens_per_sec_and_mfu(device):
    pytest.importorskip("transformers")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(BENCH + RUNS[device], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps({k: out[k] for k in ("tokens_per_sec", "mfu", "model_flops", "step_ms")}))
    assert out["config"]["device"].startswith(device)
    model = out["model_flops"]
    overrides = dict(o.split("=", 1) for o in out["config"]["overrides"])
    layers, seq, hidden = (int(overrides[f"model.{k}"]) for k in ("num_layers", "seq_length", "hidden_size"))
    assert model["flops_per_token"] == 6 * model["active_params"] + 6 * layers * seq * hidden
    assert 0 < model["active_params"] < out["parameters"]["ours"]  # top-2 of 8 experts, lookups left out
    first = out["first_step_lm_loss"]
    assert first["ours"] == pytest.approx(math.log(1024), abs=0.2)  # untrained: ~uniform over the vocab
    assert all(abs(first[s] - first["ours_fp32"]) < 2e-2 * first["ours_fp32"] for s in first)  # bf16 rounding
    if model["peak_tflops"] is None:  # a GPU missing from PEAK_BF16_TFLOPS: null, with the reason
        assert model["mfu_null_reason"] and all(v is None for v in out["mfu"].values())
        pytest.skip(f"{out['machine']['cuda_device']}: {model['mfu_null_reason']}")
    assert model["mfu_null_reason"] is None
    assert set(out["mfu"]) == set(out["tokens_per_sec"]) == set(first)
    for side, tokens_per_sec in out["tokens_per_sec"].items():
        assert tokens_per_sec > 0, side
        assert 0 < out["mfu"][side] < 1, (side, out["mfu"][side])
        want = model["flops_per_token"] * tokens_per_sec / (model["peak_tflops"] * 1e12)
        assert out["mfu"][side] == pytest.approx(want, rel=1e-3), side  # 4 significant digits
