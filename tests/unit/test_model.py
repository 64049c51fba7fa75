"""The GPT model on one process against an independent functional implementation, plus the
pieces around it: loss mask, causality, padded-vocabulary cross-entropy, bf16, attention masks,
the dropout RNG scheme and which layers are MoE."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from megatron_moe.config.schema import Config
from megatron_moe.distributed.parallel_state import ParallelState, RankLayout
from megatron_moe.model.attention import SelfAttention
from megatron_moe.model.gpt import GPTMoEModel
from megatron_moe.tensor_parallel.param_meta import init_model_from_seed_
from megatron_moe.model.transformer import moe_layer_flags
from megatron_moe.tensor_parallel import DropoutRNG, vocab_parallel_cross_entropy

TOL = dict(rtol=1e-5, atol=1e-6)
GPT2 = dict(normalization="layernorm", activation="gelu", position_embedding="learned", bias=True, tie_embeddings=True)
MIXTRAL = dict(normalization="rmsnorm", activation="swiglu", position_embedding="rope", bias=False,
               tie_embeddings=False)
QWEN3 = dict(MIXTRAL, num_attention_heads=8, num_query_groups=2, head_dim=6, qk_norm="head")  # GQA, d != h / heads
OLMOE = dict(MIXTRAL, num_query_groups=2, qk_norm="full")
QWEN2 = dict(MIXTRAL, qkv_bias=True)
SINGLE = ParallelState.single_process()


def _config(flavour, dropout=0.0):
    cfg = Config()
    cfg.model.num_layers, cfg.model.hidden_size, cfg.model.ffn_hidden_size = 2, 32, 48
    cfg.model.num_attention_heads, cfg.model.seq_length, cfg.model.vocab_size = 4, 12, 50
    cfg.model.dropout = dropout
    for key, value in flavour.items():
        setattr(cfg.model, key, value)
    cfg.moe.layer_freq = 3  # no MoE layer among 2
    return cfg


def _reference_logits(model, cfg, tokens):
    """Plain-tensor GPT forward from the model's weights: full logits [b, s, V]."""
    m, P = cfg.model, dict(model.named_parameters())
    b, s = tokens.shape
    heads, d = m.num_attention_heads, m.head_dim or m.hidden_size // m.num_attention_heads
    groups = m.num_query_groups or heads

    def norm(x, name):
        if m.normalization == "layernorm":
            mu, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
            y = (x - mu) / torch.sqrt(var + m.norm_eps) * P[name + ".weight"]
            return y + P[name + ".bias"] if m.bias else y
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + m.norm_eps) * P[name + ".weight"]

    def linear(x, name):
        y = x @ P[name + ".weight"].T
        return y + P[name + ".bias"] if name + ".bias" in P else y

    def rms(x, weight):  # over the last dim
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + m.norm_eps) * weight

    def rope(x):  # pairs (i, i + d/2) as complex numbers rotated by pos * theta^(-2i/d)
        freqs = m.rope_theta ** (-torch.arange(0, d, 2).float() / d)
        z = torch.complex(x[..., : d // 2], x[..., d // 2:]) * torch.polar(
            torch.ones(s, d // 2), torch.arange(s).float()[:, None] * freqs)
        return torch.cat([z.real, z.imag], dim=-1)

    x = P["embedding.word.weight"][tokens]
    if m.position_embedding == "learned":
        x = x + P["embedding.position"][:s]
    causal = torch.ones(s, s).tril().bool()
    for i in range(m.num_layers):
        pre = f"layers.{i}."
        # fused rows [group, (q_1 .. q_{heads/groups} | k | v), d]
        qkv = linear(norm(x, pre + "attention_norm"), pre + "attention.qkv").view(b, s, groups, heads // groups + 2, d)
        q, k, v = qkv[:, :, :, :-2].reshape(b, s, heads, d), qkv[:, :, :, -2], qkv[:, :, :, -1]
        if m.qk_norm == "head":
            q, k = rms(q, P[pre + "attention.q_norm.weight"]), rms(k, P[pre + "attention.k_norm.weight"])
        elif m.qk_norm == "full":
            q = rms(q.reshape(b, s, -1), P[pre + "attention.q_norm.weight"]).view(b, s, heads, d)
            k = rms(k.reshape(b, s, -1), P[pre + "attention.k_norm.weight"]).view(b, s, groups, d)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads | groups, s, d]
        k = torch.stack([k[:, j // (heads // groups)] for j in range(heads)], 1)  # query head j's key / value head
        v = torch.stack([v[:, j // (heads // groups)] for j in range(heads)], 1)
        if m.position_embedding == "rope":
            q, k = rope(q), rope(k)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(~causal, float("-inf"))
        context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1)
        x = x + linear(context, pre + "attention.proj")
        h = norm(x, pre + "ffn_norm")
        if m.activation == "swiglu":  # fc1 weight [2, f, h] / bias [2, f]: (gate, up)
            gate, up = (h @ P[pre + "ffn.fc1.weight"][j].T + (P[pre + "ffn.fc1.bias"][j] if m.bias else 0)
                        for j in range(2))
            u = gate * torch.sigmoid(gate) * up
        else:
            u = linear(h, pre + "ffn.fc1")
            u = 0.5 * u * (1 + torch.erf(u / math.sqrt(2)))
        x = x + linear(u, pre + "ffn.fc2")
    out = P["embedding.word.weight"] if m.tie_embeddings else P["output.weight"]
    return norm(x, "final_norm") @ out.T


def _batch(cfg, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.model.vocab_size, (3, cfg.model.seq_length), generator=gen)
    labels = torch.randint(0, cfg.model.vocab_size, (3, cfg.model.seq_length), generator=gen)
    return tokens, labels


@pytest.mark.parametrize("flavour", [GPT2, MIXTRAL, QWEN3, OLMOE, QWEN2], ids=["gpt2", "mixtral", "qwen3", "olmoe", "qwen2"])
def test_gpt_matches_functional_reference(flavour):
    cfg = _config(flavour)
    model = GPTMoEModel(cfg, SINGLE)
    with torch.no_grad():  # norm weights away from their init of ones, biases away from zeros
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    tokens, labels = _batch(cfg)
    ref_logits = _reference_logits(model, cfg, tokens)
    assert_close(model.gather_logits(model(tokens).logits), ref_logits, **TOL)

    loss_mask = (torch.arange(cfg.model.seq_length) % 3 != 0).float().expand(3, -1)
    out = model(tokens, labels, loss_mask)
    per_token = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten(), reduction="none")
    expected = (per_token * loss_mask.flatten()).sum() / loss_mask.sum()
    assert_close(out.lm_loss, expected, **TOL)
    assert out.logits is None and out.aux_loss.item() == 0.0 and out.moe_stats == []
    assert model.moe_layers() == []

    # gradients of the loss through the model equal those through the reference
    out.lm_loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    expected.backward()
    for name, p in model.named_parameters():
        assert_close(grads[name], p.grad, **TOL, msg=name)


def test_init_follows_seed_and_std():
    cfg = _config(GPT2)
    a, b = GPTMoEModel(cfg, SINGLE), GPTMoEModel(cfg, SINGLE)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    params = dict(a.named_parameters())
    assert torch.equal(params["layers.0.attention_norm.weight"], torch.ones(32))
    assert not params["layers.0.ffn.fc1.bias"].any()
    # GPT-2 residual projections use std / sqrt(2 * num_layers)
    assert params["layers.1.ffn.fc2.weight"].meta.std == pytest.approx(0.02 / 2)
    assert params["layers.1.ffn.fc2.weight"].std().item() == pytest.approx(0.01, rel=0.15)
    cfg.training.seed += 1
    assert not torch.equal(GPTMoEModel(cfg, SINGLE).embedding.word.weight, a.embedding.word.weight)


def test_causal_future_tokens_do_not_change_past_logits():
    cfg = _config(MIXTRAL)
    model = GPTMoEModel(cfg, SINGLE)
    tokens, _ = _batch(cfg)
    changed = tokens.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % cfg.model.vocab_size
    a, b = model(tokens).logits, model(changed).logits
    assert_close(a[:, :7], b[:, :7], **TOL)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_cross_entropy_ignores_padded_vocab_and_runs_in_fp32():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 6, 10, generator=gen) * 4  # 8 real entries + 2 padding columns
    labels = torch.randint(0, 8, (4, 6), generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype).detach().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(x, labels, SINGLE.tp, vocab_size=8)
        assert loss.dtype == torch.float32
        ref_x = x.detach().float().requires_grad_(True)
        ref = F.cross_entropy(ref_x[..., :8].flatten(0, 1), labels.flatten(), reduction="none").view(4, 6)
        assert_close(loss, ref, **TOL)
        loss.sum().backward()
        ref.sum().backward()
        assert x.grad.dtype == dtype and not x.grad[..., 8:].any()
        assert_close(x.grad.float(), ref_x.grad, **(TOL if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)))


def test_bf16_autocast_loss_is_fp32_and_close():
    cfg = _config(MIXTRAL)
    model = GPTMoEModel(cfg, SINGLE)
    tokens, labels = _batch(cfg)
    ref = model(tokens, labels).lm_loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(tokens, labels)
    assert out.lm_loss.dtype == torch.float32
    assert out.lm_loss.item() == pytest.approx(ref.item(), rel=2e-2)
    out.lm_loss.backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("causal", [True, False])
def test_attention_padding_mask_and_dropout_path(causal):
    cfg = _config(MIXTRAL)
    attn = SelfAttention(cfg.model, SINGLE, DropoutRNG(0, SINGLE), output_std=0.02, causal=causal)
    init_model_from_seed_(attn, 3, SINGLE)
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(2))
    padding = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    out = attn(x, padding)
    # keys at padded positions are ignored: changing them does not change the real tokens' outputs
    x2 = x.clone()
    x2[1, 4:] += 1.0
    assert_close(attn(x2, padding)[:, :4], out[:, :4], **TOL)
    assert_close(attn(x, None)[0], out[0], **TOL)  # unpadded sample = no mask
    # the explicit-softmax path taken with dropout (p -> 0 keeps everything) equals SDPA
    attn.attn_dropout.p = 1e-12
    assert_close(attn.train()(x, padding), out, **TOL)


def test_dropout_masks_shared_across_tp_and_distinct_elsewhere():
    layout = RankLayout(world_size=4, tensor=2)  # tp groups {0,1} {2,3}, dp groups {0,2} {1,3}
    rngs = [DropoutRNG(7, ParallelState.build(layout, rank)) for rank in range(4)]
    masks = {region: [r.dropout(torch.ones(256), 0.5, region) for r in rngs] for region in ("replicated", "sharded")}
    rep, shd = masks["replicated"], masks["sharded"]
    assert torch.equal(rep[0], rep[1]) and torch.equal(rep[2], rep[3]) and not torch.equal(rep[0], rep[2])
    assert len({tuple(m.tolist()) for m in shd}) == 4
    assert set(rep[0].unique().tolist()) == {0.0, 2.0}
    # the generator state round-trips (checkpoints)
    saved = rngs[0].state_dict()
    first = rngs[0].dropout(torch.ones(64), 0.5, "sharded")
    rngs[0].load_state_dict(saved)
    assert torch.equal(rngs[0].dropout(torch.ones(64), 0.5, "sharded"), first)


def test_dropout_only_in_training():
    cfg = _config(GPT2, dropout=0.3)
    model = GPTMoEModel(cfg, SINGLE)
    tokens, labels = _batch(cfg)
    no_dropout = GPTMoEModel(_config(GPT2), SINGLE)
    eval_loss = model.eval()(tokens, labels).lm_loss
    assert torch.equal(eval_loss, no_dropout(tokens, labels).lm_loss)
    model.train()
    a, b = model(tokens, labels).lm_loss, model(tokens, labels).lm_loss
    assert not torch.equal(a, b) and not torch.equal(a, eval_loss)


def test_moe_layer_indices():
    def moe(freq, first_k_dense=0, pattern=None, mtp=0):
        cfg = Config()
        cfg.model.num_layers, cfg.model.mtp_depth = 6, mtp
        cfg.moe.layer_freq, cfg.moe.first_k_dense, cfg.moe.layer_pattern = freq, first_k_dense, pattern
        return [i for i, flag in enumerate(moe_layer_flags(cfg)) if flag]

    assert moe(1) == [0, 1, 2, 3, 4, 5]
    assert moe(2) == [1, 3, 5]
    assert moe(7) == [] and moe(7, mtp=2) == []  # a dense model's MTP layers stay dense
    assert moe(1, first_k_dense=3) == [3, 4, 5] and moe(2, first_k_dense=2) == [3, 5]
    assert moe(1, pattern=[0, 1, 1, 0, 1, 0]) == [1, 2, 4]
    # MTP depth k is layer 6 + k - 1, MoE as the last layer (DeepSeek-V3: first 3 dense, the rest and MTP MoE)
    assert moe(1, first_k_dense=3, mtp=2) == [3, 4, 5, 6, 7] and moe(1, pattern=[1, 1, 1, 1, 1, 0], mtp=1) == [0, 1, 2, 3, 4]


def test_sequence_longer_than_positions_is_rejected():
    cfg = _config(GPT2)
    with pytest.raises(ValueError, match="model.seq_length"):
        GPTMoEModel(cfg, SINGLE)(torch.zeros(1, cfg.model.seq_length + 1, dtype=torch.long))


def test_apex_norm_kernels_only_from_the_real_apex(tmp_path, monkeypatch):
    """The PyPI package named `apex` (a web toolkit) is never taken for NVIDIA apex: without the
    compiled `fused_layer_norm_cuda` extension the norms stay on PyTorch's kernels, and CPU
    tensors never ask for apex at all (model/norm.py)."""
    from megatron_moe.model import norm

    (tmp_path / "apex").mkdir()
    (tmp_path / "apex" / "__init__.py").write_text("WEB_TOOLKIT = True\n")  # the impostor's shape
    (tmp_path / "apex" / "normalization").mkdir()  # even with a normalization package: no CUDA extension
    (tmp_path / "apex" / "normalization" / "__init__.py").write_text("")
    (tmp_path / "apex" / "normalization" / "fused_layer_norm.py").write_text(
        "def fused_layer_norm_affine(*a): raise AssertionError\ndef fused_rms_norm_affine(*a): raise AssertionError\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    norm.apex_fused_norms.cache_clear()
    try:
        assert norm.apex_fused_norms() is None
        assert norm._apex(torch.ones(2)) is None
    finally:
        norm.apex_fused_norms.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_node_matches_complex_rotation(dtype):
    """`apply_rotary`'s one autograd node (model/rotary.py) on both layouts it is given, `[b, heads,
    s, d]` and the attention's `[b, s, G, per_group + 1, d]`: output and input gradient equal the
    rotation of complex pairs in float64 (backward: the rotation by the negated angle), to fp32
    rounding, or in bf16 to one rounding of the result (rel 2^-8)."""
    from megatron_moe.model.rotary import apply_rotary, rotary_cos_sin
    s, d, theta = 12, 8, 10000.0
    cos, sin = rotary_cos_sin(s, d, theta, torch.device("cpu"))
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    turn = torch.polar(torch.ones(s, d // 2, dtype=torch.float64), torch.arange(s, dtype=torch.float64)[:, None] * freqs)

    def reference(x, seq_dim):  # rotate pairs (i, i + d/2) of x (float64) by position
        z = torch.complex(x[..., : d // 2], x[..., d // 2:])
        shape = [1] * x.dim()
        shape[seq_dim], shape[-1] = s, d // 2
        z = z * turn.view(shape)
        return torch.cat([z.real, z.imag], dim=-1)

    gen = torch.Generator().manual_seed(0)
    tol = 1e-6 if dtype == torch.float32 else 2.0 ** -8
    for shape, seq_dim in (((2, 3, s, d), 2), ((2, s, 2, 3, d), 1)):
        x = torch.randn(shape, generator=gen).to(dtype).requires_grad_(True)
        dy = torch.randn(shape, generator=gen).to(dtype)
        y = apply_rotary(x, cos, sin, seq_dim=seq_dim)
        assert y.dtype == dtype and y.shape == x.shape
        (dx,) = torch.autograd.grad(y, x, dy)
        x64 = x.detach().double().requires_grad_(True)
        y64 = reference(x64, seq_dim)
        (dx64,) = torch.autograd.grad(y64, x64, dy.double())
        for got, want in ((y, y64), (dx, dx64)):
            err = (got.double() - want).abs().max() / want.abs().max()
            assert err <= tol, (shape, float(err))


def test_rotary_tables_computed_once_per_stage():
    """`RotaryTables` (model/rotary.py): one module shared by every layer of a model, its rows
    exactly `rotary_cos_sin`'s (computed for a longer sequence than `model.seq_length`), fp32
    after the bf16 cast, not in the state dict, and moved with the model."""
    from megatron_moe.model.precision import cast_params_
    from megatron_moe.model.rotary import rotary_cos_sin
    cfg = _config(MIXTRAL)
    model = GPTMoEModel(cfg, SINGLE)
    tables = {id(layer.attention.rotary) for layer in model.layers}
    assert tables == {id(model.rotary)}
    d, theta = cfg.model.hidden_size // cfg.model.num_attention_heads, cfg.model.rope_theta
    for s in (1, 5, cfg.model.seq_length, cfg.model.seq_length + 3):
        want = rotary_cos_sin(s, d, theta, torch.device("cpu"))
        for got, ref in zip(model.rotary(s), want):
            assert torch.equal(got, ref), s
    cast_params_(model, "bf16")
    assert model.rotary.cos.dtype == model.rotary.sin.dtype == torch.float32
    assert not any("rotary" in name for name in model.state_dict())
    assert model.to(torch.device("meta")).rotary.cos.is_meta
    assert GPTMoEModel(_config(GPT2), SINGLE).rotary is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_node_is_autograd_bit_for_bit(dtype):
    """`ffn_activation`'s SwiGLU node (model/mlp.py) writes d gate and d up into the halves of one
    gradient: output and input gradient equal autograd through silu(gate) * up exactly, and it
    saves no more than autograd does (gate, up, silu(gate))."""
    from megatron_moe.model.mlp import ffn_activation
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 2 * 24, generator=gen).to(dtype).requires_grad_(True)
    dy = torch.randn(37, 24, generator=gen).to(dtype)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t)[1], lambda t: t):
        y = ffn_activation(x, "swiglu")
    (dx,) = torch.autograd.grad(y, x, dy)
    x_ref = x.detach().requires_grad_(True)
    gate, up = x_ref.chunk(2, dim=-1)
    y_ref = torch.nn.functional.silu(gate) * up
    (dx_ref,) = torch.autograd.grad(y_ref, x_ref, dy)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    assert sum(t.numel() for t in saved) == 3 * y.numel()
    with torch.no_grad():  # no gradient: the plain formula, no node
        assert torch.equal(ffn_activation(x, "swiglu"), y_ref)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_core_attention_bf16_backward(causal):
    """`core_attention` in bf16 on the CPU (model/core_attention.py): the forward is torch's flash
    kernel, bit for bit; the recomputed backward's gradients are at least as close to float64 (of
    the same bf16 inputs) as the flash backward's: rel 3e-3 to 9e-3, a few bf16 roundings (u = 2^-8).
    Shapes: more heads than one chunk holds, a sequence the query blocks do not divide, logits
    spread enough to reach the exponent's clamp. Elsewhere (fp32, no gradient, sequences over
    MAX_RECOMPUTE_SEQ) it is plain SDPA."""
    from megatron_moe.model import core_attention as ca
    gen = torch.Generator().manual_seed(0)
    for b, heads, s, d in ((3, 5, 250, 32), (2, 2, 7, 16)):
        q, k, v, dy = (torch.randn(b, heads, s, d, generator=gen).bfloat16() for _ in range(4))
        q = (q.float() * 6).bfloat16()  # logits with a std of ~6 after the 1/sqrt(d) scale: exp's floor is reached
        x64 = [t.double().requires_grad_(True) for t in (q, k, v)]
        y64 = F.scaled_dot_product_attention(*x64, is_causal=causal)
        want = torch.autograd.grad(y64, x64, dy.double())
        flash, ours = [[t.clone().requires_grad_(True) for t in (q, k, v)] for _ in range(2)]
        y_flash = F.scaled_dot_product_attention(*flash, is_causal=causal)
        y_ours = ca.core_attention(*ours, causal)
        assert torch.equal(y_ours, y_flash)
        got_flash = torch.autograd.grad(y_flash, flash, dy)
        got_ours = torch.autograd.grad(y_ours, ours, dy)
        for name, a, f, w in zip("qkv", got_ours, got_flash, want):
            assert a.dtype == torch.bfloat16 and a.shape == w.shape
            err, flash_err = ((g.double() - w).norm() / w.norm() for g in (a, f))
            assert err <= 1.02 * flash_err and err < 4 * 2.0 ** -8, (b, s, name, float(err), float(flash_err))
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16, requires_grad=True)
    for args, plain in (((q.float(), q.float(), q.float()), True), ((q.detach(),) * 3, True), ((q, q, q), False)):
        node = ca.core_attention(*args, causal).grad_fn
        assert (node is None or "FlashRecomputed" not in type(node).__name__) == plain
    long = torch.randn(1, 1, ca.MAX_RECOMPUTE_SEQ + 1, 8, dtype=torch.bfloat16, requires_grad=True)
    assert "FlashRecomputed" not in type(ca.core_attention(long, long, long, causal).grad_fn).__name__


def test_attention_dropout_path_scores_in_fp32():
    """With attention dropout in training (the explicit-softmax path of model/attention.py), bf16 q, k
    give fp32 scores q k^T / sqrt(d), as `core_attention`'s: rounded to bf16 before the fp32 softmax,
    dq is off by ~7e-2 (rel) at a logit std of ~36, against ~8e-3 in fp32 (docs/precision.md).
    Reference: float64 of the same bf16 inputs with the same dropout mask (the generator replayed)."""
    cfg = _config(MIXTRAL, dropout=0.1)
    rng = DropoutRNG(5, SINGLE)
    attn = SelfAttention(cfg.model, SINGLE, rng, output_std=0.02).train()  # causal, head_dim 8
    b, heads, s, d, p = 2, 4, 64, attn.head_dim, cfg.model.dropout
    gen = torch.Generator().manual_seed(0)
    q, k, v, dy = (torch.randn(b, heads, s, d, generator=gen).bfloat16() for _ in range(4))
    q = (q.float() * 36).bfloat16()  # logits q.k / sqrt(d) with a std of ~36
    generator = rng.generator("sharded", q.device)
    start = generator.get_state()
    x = [t.clone().requires_grad_(True) for t in (q, k, v)]
    y = attn._attend(*x, None)  # [b, heads, s, d] bf16
    got = torch.autograd.grad(y, x, dy)
    generator.set_state(start)
    keep = rng.dropout(torch.ones(b, heads, s, s), p, "sharded") > 0  # the mask the forward drew
    x64 = [t.double().requires_grad_(True) for t in (q, k, v)]
    scores = (x64[0] @ x64[1].transpose(-2, -1) * d ** -0.5).masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(),
                                                                        float("-inf"))
    y64 = (torch.softmax(scores, -1) * keep / (1 - p)) @ x64[2]
    want = torch.autograd.grad(y64, x64, dy.double())
    errors = {name: float((g.double() - w).norm() / w.norm()) for name, g, w in zip("qkv", got, want)}
    assert all(g.dtype == torch.bfloat16 for g in got) and errors["v"] < 1e-2, errors
    assert errors["q"] < 2e-2 and errors["k"] < 2e-2, errors  # bf16 scores: 7e-2 and more
