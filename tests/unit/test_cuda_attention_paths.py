"""The CUDA-only attention paths of issues #45 / #46 on one GPU (`make test-gpu`; skipped without
CUDA), each against the CPU path on the same weights (fp32, rtol / atol 1e-5):

* standard GQA attention with a sliding window and key padding: on CUDA one SDPA call on
  un-repeated K/V with the window mask (`core_attention.fused_attention`, `enable_gqa`), forward
  and backward equal the CPU's repeated-K/V path;
* MLA (q / k width nope + rope = 10, v width 5) through `fused_attention`, forward and backward,
  causal and with padding;
* attention sinks: the explicit softmax runs on CUDA too (`SelfAttention.fused` is False; SDPA takes
  no sinks), with a window and padding, gradients of the sinks included;
* greedy KV-cache generation (megatron_moe/generation.py: the cache's `[b, 1, s, T]` mask on the
  fused path, or the explicit one with sinks) of tests/unit/test_generation.py's tiny models: MLA
  with YaRN, sinks + windows + partial rotary, GQA with rotary, and windows without sinks.

Padding is on the right and shorter than the window, so no query row is fully masked (SDPA
kernels disagree on such rows, whose outputs no real token reads).
"""
import copy

import pytest
import torch

from megatron_moe.config.schema import Config
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.generation import generate
from megatron_moe.model import attention
from megatron_moe.model.attention import ATTENTIONS
from megatron_moe.tensor_parallel import DropoutRNG
from megatron_moe.tensor_parallel.param_meta import init_model_from_seed_
from tests.unit.test_generation import CASES, NEW, PROMPTS, ROPE, tiny_model

pytestmark = pytest.mark.gpu
SINGLE = ParallelState.single_process()
TOL = dict(rtol=1e-5, atol=1e-5)
B, S, H, W = 2, 7, 32, 3  # batch, sequence, hidden, sliding window
WINDOW = dict(num_attention_heads=4, num_query_groups=2, sliding_window=W, position_embedding="rope")
SINKS = dict(WINDOW, attention_sinks=True, qkv_bias=True, attention_output_bias=True)
MLA = dict(num_attention_heads=4, q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4,
           v_head_dim=5, position_embedding="rope", attention="mla", bias=False)
GENERATION = {**{case: CASES[case] for case in ("mla_yarn", "window_sinks", "gqa_rope")},
              "window_fused": ROPE + ["model.num_query_groups=2", "model.sliding_window=4",
                                      "model.layer_types=[sliding_attention,full_attention]"]}


def _padding() -> torch.Tensor:
    """`[B, S]`: sequence 1 ends in W - 1 padding keys (right padding)."""
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, S - (W - 1):] = 0
    return mask


def _attention(**model) -> torch.nn.Module:
    """The attention module of `model` (ModelConfig keys) on the CPU, every weight (biases and sink
    logits too) off its init, in eval mode (no dropout)."""
    cfg = Config().model
    cfg.hidden_size, cfg.seq_length, cfg.num_layers, cfg.dropout = H, S, 2, 0.0
    for key, value in model.items():
        setattr(cfg, key, value)
    attn = ATTENTIONS.get(cfg.attention)(cfg, SINGLE, DropoutRNG(3, SINGLE), output_std=0.02)
    init_model_from_seed_(attn, 3, SINGLE)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return attn.eval()


@pytest.fixture
def fused_calls(monkeypatch):
    """(query heads, key heads, q width, v width, masked) of every `fused_attention` call."""
    calls, real = [], attention.fused_attention

    def recording(q, k, v, causal, mask=None, *args, **kwargs):
        calls.append((q.shape[1], k.shape[1], q.shape[-1], v.shape[-1], mask is not None))
        return real(q, k, v, causal, mask, *args, **kwargs)

    monkeypatch.setattr(attention, "fused_attention", recording)
    return calls


def _run(attn, x, padding_mask):
    """Output, dx and every parameter's gradient (on the CPU) of a weighted sum of the output."""
    x = x.clone().requires_grad_(True)
    y = attn(x, padding_mask)
    (y * torch.linspace(-1, 1, y.numel(), device=y.device).view(y.shape)).sum().backward()
    return y.detach().cpu(), x.grad.cpu(), {n: p.grad.cpu() for n, p in attn.named_parameters()}


def _cuda_equals_cpu(model: dict, padded: bool) -> None:
    cpu = _attention(**model)
    cuda = copy.deepcopy(cpu).cuda()
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(1))
    mask = _padding() if padded else None
    want = _run(cpu, x, mask)
    got = _run(cuda, x.cuda(), None if mask is None else mask.cuda())
    torch.testing.assert_close(got[0], want[0], **TOL)
    torch.testing.assert_close(got[1], want[1], **TOL)
    assert got[2].keys() == want[2].keys()
    for name, grad in want[2].items():
        torch.testing.assert_close(got[2][name], grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_window_and_padding_take_the_fused_path_and_equal_the_cpu(fused_calls):
    _cuda_equals_cpu(WINDOW, padded=True)
    assert fused_calls == [(4, 2, 8, 8, True)]  # one SDPA call, un-repeated K/V, the window mask


@pytest.mark.parametrize("padded", [False, True])
def test_mla_q_k_wider_than_v_on_cuda_equals_the_cpu(fused_calls, padded):
    _cuda_equals_cpu(MLA, padded)
    assert fused_calls == [(4, 4, 10, 5, padded)]


def test_sinks_take_the_explicit_path_on_cuda_and_equal_the_cpu(fused_calls):
    _cuda_equals_cpu(SINKS, padded=True)
    assert fused_calls == []


@pytest.mark.parametrize("case", list(GENERATION))
def test_greedy_generation_on_cuda_equals_the_cpu(case, fused_calls):
    cpu = tiny_model(GENERATION[case])
    want = [o.tokens for o in generate(cpu, PROMPTS, NEW)]
    fused_calls.clear()
    got = [o.tokens for o in generate(copy.deepcopy(cpu).cuda(), PROMPTS, NEW)]
    assert got == want, case
    masked = [call[-1] for call in fused_calls]
    if case == "window_sinks":  # sinks: every layer explicit
        assert masked == []
    else:  # every layer, every step through SDPA with the cache's mask
        assert masked and all(masked), case
