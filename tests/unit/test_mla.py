"""Multi-head latent attention (model/mla.py), YaRN and partial rotary (model/rotary.py) against
transformers' own code: `DeepseekV3Attention` with the same weights (fp32, 1e-5; also its
`rope_interleave: true` layout after the conversion's row permutation), `_compute_yarn_parameters`
(DeepSeek-style mscale / mscale_all_dim and gpt-oss-style truncate=false), Glm4Moe's partial
`apply_rotary_pos_emb`; MLA's core paths (bf16 CPU, selective recompute, padding mask, compile);
the config rules."""
import math

import pytest
import torch
from torch.testing import assert_close

from megatron_moe.config.errors import ConfigError
from megatron_moe.config.schema import Config, RopeScalingConfig
from megatron_moe.config.validate import validate_config
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.attention import ATTENTIONS, rotary_tables
from megatron_moe.model.mla import MultiLatentAttention
from megatron_moe.model.rotary import apply_rotary, inverse_frequencies, rotary_cos_sin
from megatron_moe.tensor_parallel import DropoutRNG
from megatron_moe.tensor_parallel.param_meta import init_model_from_seed_

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

SINGLE = ParallelState.single_process()
TOL = dict(rtol=1e-5, atol=1e-5)
MLA = dict(num_attention_heads=4, hidden_size=32, q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6,
           qk_rope_head_dim=4, v_head_dim=5, position_embedding="rope", attention="mla", bias=False, norm_eps=1e-6)
DEEPSEEK_YARN = dict(type="yarn", factor=40.0, original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0,
                     mscale=0.707, mscale_all_dim=1.0)


def _config(seq=8, **model):
    cfg = Config()
    cfg.model.seq_length, cfg.model.vocab_size, cfg.model.num_layers = seq, 64, 2
    for key, value in {**MLA, **model}.items():
        setattr(cfg.model, key, RopeScalingConfig(**value) if key == "rope_scaling" else value)
    return cfg


def _mla(cfg, **kwargs):
    module = ATTENTIONS.get("mla")(cfg.model, SINGLE, DropoutRNG(1, SINGLE), output_std=0.02, **kwargs)
    init_model_from_seed_(module, 3, SINGLE)
    return module


def _hf_rope(scaling: dict):
    out = dict(rope_type=scaling["type"], rope_theta=10000.0)
    out.update({k: v for k, v in scaling.items() if k != "type"})
    return out


# ---------------------------------------------------------------- YaRN and partial rotary tables

@pytest.mark.parametrize("family", ["deepseek", "deepseek_mscale_equal", "gpt_oss", "glm_partial"])
def test_rotary_tables_match_transformers(family):
    """inv_freq bit for bit and the attention factor of `_compute_yarn_parameters` (DeepSeek: mscale
    0.707 vs mscale_all_dim 1, and both 1; gpt-oss: truncate=false), and cos / sin of our tables
    (`rotary_tables`, the one place they are built) against HF's rotary embedding modules; GLM's
    partial rotary (rotary_percent 0.5) tables rotary_dim wide."""
    from transformers import DeepseekV3Config, Glm4MoeConfig, GptOssConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding
    seq = 64
    if family.startswith("deepseek"):
        scaling = dict(DEEPSEEK_YARN, mscale=1.0) if family == "deepseek_mscale_equal" else DEEPSEEK_YARN
        hf = DeepseekV3Config(hidden_size=32, num_attention_heads=4, qk_rope_head_dim=8, max_position_embeddings=seq,
                              rope_parameters=_hf_rope(scaling))
        cfg, embedding, dim = _config(seq, qk_rope_head_dim=8, rope_scaling=scaling), DeepseekV3RotaryEmbedding, 8
    elif family == "gpt_oss":
        scaling = dict(type="yarn", factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                       truncate=False)
        hf = GptOssConfig(hidden_size=32, num_attention_heads=4, head_dim=16, max_position_embeddings=seq,
                          rope_parameters=dict(_hf_rope(scaling), rope_theta=150000.0))
        cfg = _config(seq, attention="standard", head_dim=16, rope_theta=150000.0, rope_scaling=scaling,
                      **{k: None for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                           "v_head_dim")})
        embedding, dim = GptOssRotaryEmbedding, 16
    else:
        hf = Glm4MoeConfig(hidden_size=32, num_attention_heads=4, head_dim=12, max_position_embeddings=seq,
                           rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))
        cfg = _config(seq, attention="standard", head_dim=12, rotary_percent=0.5)
        embedding, dim = Glm4MoeRotaryEmbedding, 6
    validate_config(cfg, 1)
    if family != "glm_partial":
        inv_freq, factor = inverse_frequencies(dim, cfg.model.rope_theta, cfg.model.rope_scaling)
        want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
        assert torch.equal(inv_freq, want_freq) and factor == want_factor, family
        assert (factor == 1.0) == (family == "deepseek_mscale_equal")
    tables = rotary_tables(cfg.model)
    x = torch.zeros(1, seq, 4)
    cos, sin = embedding(hf)(x, torch.arange(seq)[None])
    assert tables.cos.shape == (seq, dim)
    width = cos.shape[-1]  # gpt-oss's module returns the first half only (its rotary takes halves)
    assert_close(tables.cos[:, :width], cos[0], rtol=1e-6, atol=1e-6)
    assert_close(tables.sin[:, :width], sin[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotary_matches_glm4_moe(dtype):
    """`apply_rotary` with tables narrower than the head (rotary_percent 0.5): output and input
    gradient equal HF Glm4Moe's `apply_rotary_pos_emb` (autograd through it, fp32; bf16 within one
    rounding), eager node and compiled formula alike; the passed-through dims are untouched."""
    from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb
    b, heads, s, d, rd = 2, 3, 7, 12, 6
    cos, sin = rotary_cos_sin(s, rd, 10000.0, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(b, heads, s, d, generator=gen) for _ in range(2))
    dq, dk = (torch.randn(b, heads, s, d, generator=gen) for _ in range(2))
    q64, k64 = q.double().requires_grad_(True), k.double().requires_grad_(True)
    want_q, want_k = apply_rotary_pos_emb(q64, k64, cos.double()[None], sin.double()[None])
    want_dq, want_dk = torch.autograd.grad((want_q, want_k), (q64, k64), (dq.double(), dk.double()))
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2.0 ** -8, atol=2.0 ** -7)
    compiled = torch.compile(apply_rotary, backend="aot_eager", fullgraph=True)
    for fn in (apply_rotary, compiled):
        x = torch.stack([q, k]).to(dtype).requires_grad_(True)  # [2, b, heads, s, d], sequence at dim 3
        y = fn(x, cos, sin, seq_dim=3)
        (dx,) = torch.autograd.grad(y, x, torch.stack([dq, dk]).to(dtype))
        assert y.dtype == dtype
        assert torch.equal(y[..., rd:], x[..., rd:].detach())
        assert_close(y.double(), torch.stack([want_q, want_k]).detach(), **tol)
        assert_close(dx.double(), torch.stack([want_dq, want_dk]), **tol)


# ---------------------------------------------------------------- MLA against DeepseekV3Attention

def _hf_attention(cfg, module, interleave=False):
    """HF `DeepseekV3Attention` of `cfg`'s shape with `module`'s weights; with `interleave` HF's
    interleaved rope layout, our rotate-half rows permuted back into it."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention
    m = cfg.model
    rope = _hf_rope(vars(m.rope_scaling)) if m.rope_scaling.type == "yarn" else dict(rope_type="default",
                                                                                    rope_theta=m.rope_theta)
    hf_cfg = DeepseekV3Config(hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
                              num_key_value_heads=m.num_attention_heads, q_lora_rank=m.q_lora_rank,
                              kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
                              qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, rope_interleave=interleave,
                              max_position_embeddings=m.seq_length, attention_bias=False, rms_norm_eps=m.norm_eps,
                              rope_parameters=rope)
    hf_cfg._attn_implementation = "eager"
    hf = DeepseekV3Attention(hf_cfg, layer_idx=0)
    nope, r, heads = m.qk_nope_head_dim, m.qk_rope_head_dim, m.num_attention_heads
    # rotate-half row i of the rope part holds interleaved row 2i (i < r/2) or 2(i - r/2) + 1
    to_ours = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2)]) if interleave else torch.arange(r)
    from_ours = torch.argsort(to_ours)

    def rope_rows(w, per, offset, count):  # permute the rope rows of `count` blocks of `per` rows
        w = w.clone().view(count, per, -1)
        w[:, offset:offset + r] = w[:, offset:offset + r][:, from_ours]
        return w.view(count * per, -1)

    with torch.no_grad():
        if m.q_lora_rank is not None:
            hf.q_a_proj.weight.copy_(module.q_down.weight)
            hf.q_a_layernorm.weight.copy_(module.q_down_norm.weight)
            hf.q_b_proj.weight.copy_(rope_rows(module.q_up.weight, nope + r, nope, heads))
        else:
            hf.q_proj.weight.copy_(rope_rows(module.q.weight, nope + r, nope, heads))
        hf.kv_a_proj_with_mqa.weight.copy_(rope_rows(module.kv_down.weight, m.kv_lora_rank + r, m.kv_lora_rank, 1))
        hf.kv_a_layernorm.weight.copy_(module.kv_down_norm.weight)
        hf.kv_b_proj.weight.copy_(module.kv_up.weight)
        hf.o_proj.weight.copy_(module.proj.weight)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding
    return hf, DeepseekV3RotaryEmbedding(hf_cfg)


@pytest.mark.parametrize("variant", ["q_lora", "no_q_lora", "yarn", "interleaved"])
def test_mla_matches_transformers_deepseek_v3(variant):
    """Output, input gradient and every weight gradient of `MultiLatentAttention` equal HF's
    `DeepseekV3Attention` with the same weights (fp32, 1e-5): with and without the query LoRA, with
    YaRN (mscale^2 in the softmax scale, the attention factor in cos / sin), and against HF's
    `rope_interleave: true` after permuting the rope rows (the conversion's job, model/mla.py)."""
    extra = {"no_q_lora": dict(q_lora_rank=None), "yarn": dict(rope_scaling=DEEPSEEK_YARN)}.get(variant, {})
    cfg = _config(**extra)
    validate_config(cfg, 1)
    ours = _mla(cfg)
    for p in ours.parameters():  # norms away from 1
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(p.numel()))
    hf, embedding = _hf_attention(cfg, ours, interleave=variant == "interleaved")
    if variant == "yarn":
        assert ours.softmax_factor > 1 and hf.scaling == pytest.approx(ours.softmax_factor * 10 ** -0.5)
    b, s = 2, cfg.model.seq_length
    gen = torch.Generator().manual_seed(1)
    x, dy = torch.randn(b, s, 32, generator=gen), torch.randn(b, s, 32, generator=gen)
    x_ours, x_hf = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y = ours(x_ours)
    causal = torch.full((s, s), float("-inf")).triu(1)[None, None]
    y_hf, _ = hf(x_hf, embedding(x_hf, torch.arange(s)[None]), causal)
    assert_close(y, y_hf, **TOL)
    (y * dy).sum().backward()
    (y_hf * dy).sum().backward()
    assert_close(x_ours.grad, x_hf.grad, **TOL)
    names = dict(q_down="q_a_proj", q_down_norm="q_a_layernorm", q_up="q_b_proj", q="q_proj",
                 kv_down="kv_a_proj_with_mqa", kv_down_norm="kv_a_layernorm", kv_up="kv_b_proj", proj="o_proj")
    grads = {n: p.grad for n, p in hf.named_parameters()}
    for name, p in ours.named_parameters():
        hf_name = names[name.split(".")[0]] + ".weight"
        if variant == "interleaved" and name.split(".")[0] in ("q_up", "q", "kv_down"):
            continue  # rows permuted: the values above already pin them
        assert_close(p.grad, grads[hf_name], **TOL, msg=name)


def test_mla_parameter_names_and_layouts():
    """The names and shapes the DeepSeek-V3 conversion maps (model/mla.py): replicated down
    projections and norms, column-parallel up projections, row-parallel output."""
    cfg = _config()
    got = {n: (tuple(p.shape), p.meta.shards) for n, p in _mla(cfg).named_parameters()}
    assert got == {"q_down.weight": ((12, 32), []), "q_down_norm.weight": ((12,), []),
                   "q_up.weight": ((40, 12), [(0, "tp")]), "kv_down.weight": ((14, 32), []),
                   "kv_down_norm.weight": ((10,), []), "kv_up.weight": ((44, 10), [(0, "tp")]),
                   "proj.weight": ((32, 20), [(1, "tp")])}
    no_lora = {n for n, _ in _mla(_config(q_lora_rank=None, attention_output_bias=True)).named_parameters()}
    assert no_lora == {"q.weight", "kv_down.weight", "kv_down_norm.weight", "kv_up.weight", "proj.weight", "proj.bias"}


def test_mla_core_paths():
    """Selective recompute gives the same output and gradients; a padding mask equals attending to the
    real keys only (bidirectional); bf16 on the CPU (q/k width != v width: SDPA, not the CPU flash
    backward) stays within bf16 rounding of fp32; an eager model and a compiled one agree."""
    cfg = _config()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 8, 32, generator=gen)

    def run(module, inp, mask=None):
        inp = inp.clone().requires_grad_(True)
        y = module(inp, mask)
        y.square().sum().backward()
        return y.detach(), inp.grad, {n: p.grad for n, p in module.named_parameters()}

    plain, recomputed = run(_mla(cfg), x), run(_mla(cfg, recompute=True), x)
    for a, b in zip(plain[:2], recomputed[:2]):
        assert torch.equal(a, b)
    for name, g in plain[2].items():
        assert torch.equal(g, recomputed[2][name]), name

    bidirectional = _mla(cfg, causal=False)
    mask = torch.ones(2, 8)
    mask[:, 5:] = 0
    y_masked = bidirectional(x, mask)
    assert_close(y_masked[:, :5], bidirectional(x[:, :5]), **TOL)

    bf16 = _mla(cfg).to(torch.bfloat16)
    y16, dx16, _ = run(bf16, x.to(torch.bfloat16))
    assert y16.dtype == torch.bfloat16
    assert_close(y16.float(), plain[0], rtol=0.05, atol=2e-3)
    assert_close(dx16.float(), plain[1], rtol=0.05, atol=2e-2)

    compiled = _mla(cfg)
    compiled.forward = torch.compile(compiled.forward, backend="aot_eager")
    y_c, dx_c, grads_c = run(compiled, x)
    assert_close(y_c, plain[0], **TOL)
    assert_close(dx_c, plain[1], **TOL)
    for name, g in grads_c.items():
        assert_close(g, plain[2][name], **TOL, msg=name)


@pytest.mark.parametrize("override,message", [
    (dict(kv_lora_rank=None), "needs model.kv_lora_rank"),
    (dict(qk_norm="head"), "model.qk_norm is not supported with model.attention=mla"),
    (dict(num_query_groups=2), "model.num_query_groups is not supported"),
    (dict(head_dim=8), "model.head_dim is not supported"),
    (dict(qkv_bias=True), "model.qkv_bias is not supported"),
    (dict(attention_sinks=True), "model.attention_sinks need model.attention=standard"),
    (dict(position_embedding="learned"), "needs model.position_embedding=rope"),
    (dict(rotary_percent=0.5), "model.rotary_percent must be 1"),
    (dict(qk_rope_head_dim=3), "model.qk_rope_head_dim=3 must be even"),
    (dict(v_head_dim=0), "model.v_head_dim=0 must be >= 1"),
    (dict(num_attention_heads=3), "parallel.tensor=2 does not divide model.num_attention_heads=3"),
    (dict(rope_scaling=dict(type="ntk")), "model.rope_scaling.type='ntk' must be one of none, yarn"),
    (dict(rope_scaling=dict(type="yarn", factor=0.5)), "model.rope_scaling.factor=0.5 must be >= 1"),
    (dict(attention="standard", rotary_percent=1.5), r"model.rotary_percent=1.5 must be in \(0, 1\]"),
    (dict(attention="standard", head_dim=6, rotary_percent=0.5), "needs an even rotary width >= 2, got 3"),
    (dict(attention="latent"), "model.attention='latent' is not registered"),
])
def test_mla_and_rotary_config_rules(override, message):
    """One-line ConfigErrors for MLA's keys, rotary_percent and rope_scaling (tp=2)."""
    cfg = _config(**override)
    cfg.parallel.tensor = 2
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg, 2)


def test_yarn_softmax_factor_is_hf_scaling():
    """HF DeepseekV3Attention.scaling = d^-1/2 x (0.1 mscale_all_dim ln s + 1)^2."""
    cfg = _config(rope_scaling=dict(DEEPSEEK_YARN, mscale_all_dim=0.8))
    module = _mla(cfg)
    assert module.softmax_factor == pytest.approx((0.1 * 0.8 * math.log(40.0) + 1) ** 2)
    assert _mla(_config()).softmax_factor == 1.0
    assert isinstance(module, MultiLatentAttention)


@pytest.mark.parametrize("keys", [dict(mscale_all_dim=1.0), dict(mscale=0.707), dict(mscale=1.0, mscale_all_dim=0.8),
                                  dict()])
def test_imported_yarn_scales_match_transformers(keys):
    """The conversion's `model.rope_scaling.*` of a YaRN config.json with either of mscale /
    mscale_all_dim absent (convert/hf_rope.py): the cos / sin attention factor equals transformers'
    `_compute_yarn_parameters` and MLA's softmax scale `DeepseekV3Attention.scaling` (a
    mscale_all_dim without mscale still scales the softmax)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention
    from megatron_moe.config import load_config
    from megatron_moe.convert.hf_rope import rope_scaling_overrides
    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=16, **keys)
    cfg = _config()
    cfg.model.rope_scaling = load_config(None, rope_scaling_overrides(rope)).model.rope_scaling
    hf = DeepseekV3Config(hidden_size=32, num_attention_heads=4, q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6,
                          qk_rope_head_dim=4, v_head_dim=5, max_position_embeddings=64, rope_parameters=dict(rope))
    _, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    assert inverse_frequencies(4, 10000.0, cfg.model.rope_scaling)[1] == pytest.approx(want_factor, rel=1e-12)
    assert _mla(cfg).softmax_factor * 10 ** -0.5 == pytest.approx(DeepseekV3Attention(hf, 0).scaling, rel=1e-12)


def test_mla_checkpoint_reshards(tmp_path):
    """tools/convert_checkpoint.py's reshard moves MLA's parameters by their ParamMeta: the replicated
    down projections and norms are saved once, the up projections in tp chunks, and the resharded
    (tensor=2 expert=2) checkpoint loads into the same model."""
    from megatron_moe import load_model
    from megatron_moe.convert import offline
    from megatron_moe.training.checkpoint_io import read_metadata
    from megatron_moe.training.trainer import Trainer
    from tests.checkpoint_helpers import mixtral_config, synthetic_datasets
    from tests.distributed.test_mla import MLA as MLA_OVERRIDES
    short = ["training.train_iters=2", "training.micro_batch_size=2", "training.global_batch_size=4",
             "model.seq_length=16", "training.eval_interval=0", "checkpoint.save_interval=2", "model.vocab_size=96"]
    Trainer(mixtral_config(tmp_path, short + MLA_OVERRIDES), SINGLE, datasets=synthetic_datasets).train()
    out = offline.reshard(str(tmp_path / "ckpt"), str(tmp_path / "t2e2"), tensor=2, expert=2, expert_shard=1)
    md = read_metadata(out).state_dict_metadata
    for name, chunks in (("q_down", 1), ("q_down_norm", 1), ("kv_down", 1), ("kv_down_norm", 1), ("q_up", 2),
                         ("kv_up", 2), ("proj", 2)):
        assert len(md[f"model/layers.0.attention.{name}.weight"].chunks) == chunks, name
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(load_model(out)(tokens), load_model(str(tmp_path / "ckpt"))(tokens))
