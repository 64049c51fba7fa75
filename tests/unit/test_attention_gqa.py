"""Issue #44 item 7: on CUDA the attention core is one SDPA call with the dropout and un-repeated
grouped-query K/V (`core_attention.fused_attention`). On the CPU the fused path is forced by
patching `SelfAttention.fused` (SDPA takes `enable_gqa` there too): it must equal the repeated-K/V
path and never call `repeat_interleave`; its dropout draws from the model's sharded generator (the
global generator untouched, the masks replayed by a recomputation). The gpu-marked test runs it on
CUDA for real."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron_moe.config.schema import Config
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.attention import SelfAttention
from megatron_moe.model.core_attention import fused_attention
from megatron_moe.tensor_parallel import DropoutRNG
from megatron_moe.tensor_parallel.param_meta import init_from_seed_

SINGLE = ParallelState.single_process()
B, S = 2, 6


def _attention(dropout: float = 0.0, recompute: bool = False, device: str = "cpu") -> SelfAttention:
    cfg = Config().model
    cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.seq_length = 32, 4, 2, S  # GQA: 2 per group
    cfg.dropout, cfg.position_embedding = dropout, "rope"
    attn = SelfAttention(cfg, SINGLE, DropoutRNG(3, SINGLE), output_std=0.02, recompute=recompute)
    for name, p in attn.named_parameters():
        init_from_seed_(p, name, 0, SINGLE)
    return attn.to(device)


def refuse_repeat(patcher) -> None:
    """Make any repeat of K/V (the method or the function) an error under `patcher`."""
    def refuse(*args, **kwargs):
        raise AssertionError("repeat_interleave on the fused attention path")

    patcher.setattr(torch.Tensor, "repeat_interleave", refuse)
    patcher.setattr(torch, "repeat_interleave", refuse)


@pytest.fixture
def no_repeat(monkeypatch):
    """Force the fused path and make any repeat of K/V an error."""
    monkeypatch.setattr(SelfAttention, "fused", lambda self, q: True)
    refuse_repeat(monkeypatch)


def _run(attn, x, padding_mask=None):
    x = x.clone().requires_grad_(True)
    y = attn(x, padding_mask)
    grads = torch.autograd.grad((y * torch.linspace(-1, 1, y.numel()).view(y.shape)).sum(), [x, attn.qkv.weight])
    return y.detach(), grads


def test_enable_gqa_equals_repeated_kv():
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(B, 4, S, 8, generator=gen), torch.randn(B, 2, S, 8, generator=gen), torch.randn(B, 2, S, 8,
                                                                                                           generator=gen)
    mask = torch.ones(B, 1, S, S, dtype=torch.bool).tril()
    mask[0, :, :, -2:] = False
    mask[0, :, -2:, 0] = True  # no row fully masked
    for causal, m in ((True, None), (False, None), (False, mask)):
        want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=m,
                                              is_causal=causal)
        torch.testing.assert_close(fused_attention(q, k, v, causal, m), want, rtol=1e-5, atol=1e-6)


def test_fused_path_equals_the_cpu_path_without_repeating_kv(monkeypatch):
    attn = _attention().eval()
    x = torch.randn(B, S, 32, generator=torch.Generator().manual_seed(2))
    padding = torch.ones(B, S)
    padding[1, -2:] = 0
    want = [_run(attn, x), _run(attn, x, padding)]
    monkeypatch.setattr(SelfAttention, "fused", lambda self, q: True)
    with monkeypatch.context() as m:
        refuse_repeat(m)
        got = [_run(attn, x), _run(attn, x, padding)]
    for (y, grads), (y_want, grads_want) in zip(got, want):
        torch.testing.assert_close(y, y_want, rtol=1e-5, atol=1e-6)
        for g, w in zip(grads, grads_want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_fused_dropout_draws_from_the_sharded_generator_and_replays(no_repeat):
    x = torch.randn(B, S, 32, generator=torch.Generator().manual_seed(4))
    plain, recomputing = _attention(0.5).train(), _attention(0.5, recompute=True).train()
    recomputing.load_state_dict(plain.state_dict())
    outside = torch.get_rng_state()
    sharded = plain.rng.generator("sharded", torch.device("cpu"))
    start = sharded.get_state()
    first = _run(plain, x)
    assert torch.equal(torch.get_rng_state(), outside)  # the global generator is untouched
    assert not torch.equal(sharded.get_state(), start)  # the sharded one advanced
    second = _run(plain, x)
    assert not torch.equal(first[0], second[0])  # a fresh mask
    sharded.set_state(start)
    again = _run(plain, x)
    recomputing.rng.generator("sharded", torch.device("cpu")).set_state(start)
    replayed = _run(recomputing, x)  # selective recomputation runs the core again in backward
    for other in (again, replayed):
        assert torch.equal(other[0], first[0]) and all(torch.equal(a, b) for a, b in zip(other[1], first[1]))
    eval_y = _run(plain.eval(), x)[0]
    assert not torch.equal(eval_y, first[0])  # dropout was active


def test_fused_only_on_cuda_and_not_for_dropout_inside_lancet_batch_parts():
    cuda, cpu = SimpleNamespace(device=torch.device("cuda", 0)), torch.zeros(1)
    attn = _attention(0.1).train()
    assert attn.fused(cuda) and not attn.fused(cpu)
    with attn.rng.batch_parts([1, 1]).part(0):  # masks are slices of whole-micro-batch ones: drawn explicitly
        assert not attn.fused(cuda)
        assert attn.eval().fused(cuda)  # no dropout: nothing to draw
    assert _attention(0.0).train().fused(cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_attention_is_one_sdpa_call_on_unrepeated_kv(dtype, monkeypatch):
    """On a GPU: the CUDA module (no repeat_interleave) equals the CPU one; its dropout replays."""
    cpu = _attention(0.5).eval()
    gpu = _attention(0.5, device="cuda").eval().to(dtype)
    x = torch.randn(B, S, 32, generator=torch.Generator().manual_seed(5))
    want = _run(cpu.to(dtype).float(), x)[0]
    refuse_repeat(monkeypatch)
    got = _run(gpu, x.to("cuda", dtype))[0]
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float().cpu(), want, **tol)
    gpu.train()
    outside = torch.cuda.get_rng_state()
    sharded = gpu.rng.generator("sharded", torch.device("cuda", torch.cuda.current_device()))
    start = sharded.get_state()
    first = _run(gpu, x.to("cuda", dtype))
    assert torch.equal(torch.cuda.get_rng_state(), outside) and not torch.equal(sharded.get_state(), start)
    sharded.set_state(start)
    again = _run(gpu, x.to("cuda", dtype))
    assert torch.equal(first[0], again[0]) and not torch.equal(first[0], got)


def test_fused_dropout_without_padding_builds_no_mask(no_repeat, monkeypatch):
    """The fused causal call with dropout passes is_causal: no [s, s] mask is built per layer for it."""
    def refuse(*args, **kwargs):
        raise AssertionError("a mask built for the fused causal call")

    monkeypatch.setattr(SelfAttention, "_allowed", refuse)
    _run(_attention(0.5).train(), torch.randn(B, S, 32))
