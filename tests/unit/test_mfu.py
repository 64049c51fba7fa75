"""MFU arithmetic of benchmarks/train_throughput.py (issue #44): the FLOPs per token of two tiny
MoE configs, worked out by hand below, the peak table and the null MFU with its reason.

FLOPs per token = 6 N + 6 L s h_q. N: the weights one token multiplies through (an MoE layer at
top_k of its experts; embedding lookups, norms and biases do no GEMM; a tied word embedding is
the output layer). 6 L s h_q: Megatron-LM's attention scores and context (12 s h_q per layer,
forward and backward, halved for the causal mask).
"""
import importlib.util
from pathlib import Path

import pytest

from megatron_moe.config import load_config
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.gpt import GPTMoEModel

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("train_throughput", ROOT / "benchmarks/train_throughput.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

# configs/mixtral_tiny.yaml: L 2, h 64, 4 heads (h_q 64), expert FFN 128, SwiGLU, 8 experts top-2,
# vocab 1024, s 64, no biases, untied output. Per layer:
#   qkv 64 x 192 = 12,288; proj 64 x 64 = 4,096; router 64 x 8 = 512;
#   one expert: w1 64 x (2 x 128) = 16,384 + w2 128 x 64 = 8,192 = 24,576; top-2: 49,152
#   (all 8: 196,608); norms: vectors
#   layer: 12,288 + 4,096 + 512 + 49,152 = 66,048; x 2 layers = 132,096
# output 1024 x 64 = 65,536 (the word embedding: a lookup)
# N = 132,096 + 65,536 = 197,632; 6 N = 1,185,792; attention 6 x 2 x 64 x 64 = 49,152
MIXTRAL_N, MIXTRAL_FLOPS = 197_632, 1_234_944
# configs/gpt_moe_tiny.yaml (tied embeddings, learned positions, GeLU, biases) with
# moe.layer_freq=2 (layer 0 dense, layer 1 MoE), a gated shared expert of FFN 32 and 2 query groups:
#   layer 0: qkv 64 x (64 + 2 x 32) = 8,192; proj 4,096; fc1 64 x 128 = 8,192; fc2 8,192 -> 28,672
#   layer 1: qkv 8,192; proj 4,096; router 512; one expert: 64 x 128 + 128 x 64 = 16,384, top-2:
#            32,768 (its biases: a vector per expert); shared gate 64 x 1 = 64; shared fc1 64 x 32 =
#            2,048, fc2 2,048 -> 49,728
#   tied word embedding = the output layer: 1024 x 64 = 65,536 (the position table: a lookup)
# N = 28,672 + 49,728 + 65,536 = 143,936; 6 N = 863,616; attention 6 x 2 x 64 x 64 = 49,152 (GQA
# shares K/V, the scores and context are per query head)
GPT_OVERRIDES = ["moe.layer_freq=2", "moe.shared_expert_ffn_hidden_size=32", "moe.shared_expert_gate=true",
                 "model.num_query_groups=2"]
GPT_N, GPT_FLOPS = 143_936, 912_768


def _model(config, overrides=()):
    cfg = load_config(config, list(overrides))
    return GPTMoEModel(cfg, ParallelState.single_process()), cfg


@pytest.mark.parametrize("config,overrides,n,flops", [
    ("configs/mixtral_tiny.yaml", [], MIXTRAL_N, MIXTRAL_FLOPS),
    ("configs/gpt_moe_tiny.yaml", GPT_OVERRIDES, GPT_N, GPT_FLOPS),
], ids=["mixtral_tiny", "gpt_moe_tiny-dense-shared-gqa"])
def test_flops_per_token_equal_the_hand_count(config, overrides, n, flops):
    model, cfg = _model(config, overrides)
    assert bench.active_gemm_params(model, cfg) == n
    assert bench.flops_per_token(model, cfg) == flops
    assert 6 * n + 6 * 2 * 64 * 64 == flops


def test_moe_counts_top_k_experts_not_all():
    model, cfg = _model("configs/mixtral_tiny.yaml")
    all_experts = MIXTRAL_N + 2 * (8 - 2) * 24_576  # every expert of both layers counted
    assert bench.active_gemm_params(model, cfg) == MIXTRAL_N < all_experts
    model1, cfg1 = _model("configs/mixtral_tiny.yaml", ["moe.top_k=1"])
    assert bench.active_gemm_params(model1, cfg1) == MIXTRAL_N - 2 * 24_576  # one expert less per layer


def test_mfu_from_the_hand_count():
    # 1e6 tokens/s on an H100 SXM: 1,234,944 x 1e6 / 989e12 = 1.2487e-3
    peak, why = bench.peak_tflops("NVIDIA H100 80GB HBM3", "bf16", None)
    assert (peak, why) == (989.0, None)
    assert bench.mfu(MIXTRAL_FLOPS, 1e6, peak) == 0.001249
    assert bench.mfu(MIXTRAL_FLOPS, 1e6, None) is None


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H200", 989.0), ("NVIDIA H100 PCIe", 756.0),
    ("NVIDIA H100 NVL", 835.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A100 80GB PCIe", 312.0),
])
def test_peak_table_by_device_name(name, peak):
    assert bench.peak_tflops(name, "bf16", None) == (peak, None)
    assert bench.peak_tflops(name, "bf16", 123.0) == (123.0, None)  # --peak-tflops wins


def test_no_peak_means_null_mfu_with_the_reason():
    peak, why = bench.peak_tflops("Tesla V100-SXM2-16GB", "bf16", None)
    assert peak is None and "Tesla V100-SXM2-16GB" in why and "--peak-tflops" in why
    peak, why = bench.peak_tflops(None, "bf16", None)  # the CPU
    assert peak is None and "CPU" in why and "--peak-tflops" in why
    peak, why = bench.peak_tflops("NVIDIA H100 80GB HBM3", "fp32", None)  # the table is bf16's
    assert peak is None and "fp32" in why and "--peak-tflops" in why
    assert bench.peak_tflops(None, "fp32", 2.5) == (2.5, None)


def test_cli_user_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--peak-tflops", "0"])
    assert e.value.code == 2 and "--peak-tflops must be > 0" in capsys.readouterr().err
    if not bench.torch.cuda.is_available():
        with pytest.raises(SystemExit) as e:
            bench.parse_args(["--device", "cuda"])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and "no CUDA GPU" in err[0]
