"""Issue #45 item 5 (gpt-oss's model features) and item 4's GLM-4.5 q/k/v biases, against
transformers' own modules (`GptOssAttention`, `GptOssExperts` via `GptOssMLP`, `GptOssTopKRouter`)
loaded with the same weights at a tiny size (fp32, 1e-5): attention sinks, sliding windows per
`model.layer_types`, q/k/v/o biases, the router bias, the experts' biases and the clamped SwiGLU,
and gpt-oss's softmax over the k selected logits == softmax + norm_topk_prob. Plus the refusals,
the bias combinations, and sinks under bf16, recomputation and the (forced) CUDA path choice."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.masking_utils import sliding_window_causal_mask_function  # noqa: E402
from transformers.models.gpt_oss import modeling_gpt_oss as hf  # noqa: E402
from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig  # noqa: E402

from megatron_moe.config.errors import ConfigError  # noqa: E402
from megatron_moe.config.schema import Config  # noqa: E402
from megatron_moe.config.validate import validate_config  # noqa: E402
from megatron_moe.distributed.parallel_state import ParallelState  # noqa: E402
from megatron_moe.model.attention import SelfAttention  # noqa: E402
from megatron_moe.moe.layer import MoELayer  # noqa: E402
from megatron_moe.moe.router import top_k_gating  # noqa: E402
from megatron_moe.tensor_parallel import DropoutRNG  # noqa: E402
from megatron_moe.tensor_parallel.param_meta import init_from_seed_  # noqa: E402

SINGLE = ParallelState.single_process()
TOL = dict(rtol=1e-5, atol=1e-5)
H, HEADS, GROUPS, D, S, B, W = 32, 4, 2, 8, 7, 2, 3  # hidden, heads, kv heads, head dim, seq, batch, window
E, K, F, LIMIT = 4, 2, 6, 0.8  # experts, top-k, expert FFN, a swiglu limit that clamps


def _hf_config(**kw) -> GptOssConfig:
    values = dict(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=GROUPS, head_dim=D,
                  num_hidden_layers=2, sliding_window=W, num_local_experts=E, num_experts_per_tok=K,
                  intermediate_size=F, swiglu_limit=LIMIT, attention_dropout=0.0)
    config = GptOssConfig(**{**values, **kw})
    config._attn_implementation = "eager"
    return config


def _model_config(**kw) -> Config:
    cfg = Config()
    m = cfg.model
    m.hidden_size, m.num_attention_heads, m.num_query_groups, m.head_dim, m.seq_length = H, HEADS, GROUPS, D, S
    m.num_layers, m.position_embedding, m.bias, m.dropout = 2, "learned", False, 0.0
    m.qkv_bias, m.attention_output_bias, m.attention_sinks, m.sliding_window = True, True, True, W
    m.layer_types = ["sliding_attention", "full_attention"]
    for key, value in kw.items():
        setattr(m, key, value)
    return cfg


def _attention(cfg: Config, layer_index: int, **kw) -> SelfAttention:
    attn = SelfAttention(cfg.model, SINGLE, DropoutRNG(3, SINGLE), output_std=0.02, layer_index=layer_index, **kw)
    for name, p in attn.named_parameters():
        init_from_seed_(p, name, 0, SINGLE)
        if p.meta.init == "zeros":  # biases: nonzero
            p.data.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    return attn


@torch.no_grad()
def _load_hf_attention(theirs: torch.nn.Module, ours: SelfAttention) -> None:
    """Our fused QKV rows [group, (q_1 .. q_{heads/G} | k | v), d] into q_proj / k_proj / v_proj."""
    per_group = HEADS // GROUPS
    for kind in ("weight", "bias"):
        rows = getattr(ours.qkv, kind).view(GROUPS, per_group + 2, D, -1)
        getattr(theirs.q_proj, kind).copy_(rows[:, :per_group].reshape(HEADS * D, -1).squeeze(-1))
        getattr(theirs.k_proj, kind).copy_(rows[:, per_group].reshape(GROUPS * D, -1).squeeze(-1))
        getattr(theirs.v_proj, kind).copy_(rows[:, per_group + 1].reshape(GROUPS * D, -1).squeeze(-1))
        getattr(theirs.o_proj, kind).copy_(getattr(ours.proj, kind))
    theirs.sinks.copy_(ours.sinks)


def _hf_mask(layer_type: str) -> torch.Tensor:
    """transformers' own additive mask [1, 1, S, S] of the layer type (its masking utils' definition)."""
    q, kv = torch.arange(S)[:, None], torch.arange(S)[None, :]
    allowed = sliding_window_causal_mask_function(W)(0, 0, q, kv) if layer_type == "sliding_attention" else kv <= q
    return torch.zeros(S, S).masked_fill(~allowed, float("-inf"))[None, None]


def _grads(y, tensors):
    return torch.autograd.grad((y * torch.linspace(-1, 1, y.numel()).view(y.shape)).sum(), tensors)


@pytest.mark.parametrize("layer_index", [0, 1])
def test_attention_equals_gpt_oss_attention(layer_index):
    """Sinks, sliding window (layer 0) or full (layer 1), GQA, q/k/v/o biases: output and
    gradients equal transformers' eager GptOssAttention (identity rotary on both sides)."""
    config = _hf_config()
    theirs = hf.GptOssAttention(config, layer_idx=layer_index)
    assert (theirs.sliding_window is not None) == (layer_index == 0)
    ours = _attention(_model_config(), layer_index)
    assert ours.window == (W if layer_index == 0 else None)
    _load_hf_attention(theirs, ours)
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(1))
    x_ours, x_theirs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    identity = (torch.ones(B, S, D // 2), torch.zeros(B, S, D // 2))
    y_theirs = theirs(x_theirs, identity, _hf_mask(config.layer_types[layer_index]))[0]
    y_ours = ours(x_ours)
    torch.testing.assert_close(y_ours, y_theirs, **TOL)
    g_ours = _grads(y_ours, [x_ours, ours.sinks, ours.proj.bias, ours.qkv.bias])
    g_theirs = _grads(y_theirs, [x_theirs, theirs.sinks, theirs.o_proj.bias])
    for a, b in zip(g_ours, g_theirs):
        torch.testing.assert_close(a, b, **TOL)
    assert g_ours[3].abs().sum() > 0


def test_window_is_transformers_off_by_one():
    """Query i sees keys i - W < j <= i: W keys, its own included."""
    ours = _attention(_model_config(attention_sinks=False), 0)
    allowed = ours._allowed(S, None, torch.device("cpu"))[0, 0]
    assert torch.equal(allowed, _hf_mask("sliding_attention")[0, 0] == 0)
    assert allowed.sum(1).tolist() == [min(i + 1, W) for i in range(S)]


def test_sinks_path_choice_recompute_and_bf16(monkeypatch):
    """Sinks never take SDPA (CUDA's fused path included) nor core_attention's bf16 CPU backward;
    selective recomputation gives the same gradients; bf16 stays within bf16 tolerance of fp32."""
    cfg = _model_config()
    ours = _attention(cfg, 0)
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda")), raising=False)
    assert not ours.fused(torch.empty(1))  # on CUDA too (the explicit softmax: SDPA takes no sinks)
    monkeypatch.undo()
    recomputing = _attention(cfg, 0, recompute=True)
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(2))
    runs = []
    for module in (ours, recomputing):
        xr = x.clone().requires_grad_(True)
        y = module(xr)
        runs.append((y.detach(), *_grads(y, [xr, module.sinks, module.qkv.weight])))
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    half = _attention(cfg, 0).to(torch.bfloat16)
    xb = x.to(torch.bfloat16).requires_grad_(True)
    yb = half(xb)
    torch.testing.assert_close(yb.float(), runs[0][0], rtol=0.05, atol=0.02)
    gb = _grads(yb.float(), [xb, half.sinks])
    torch.testing.assert_close(gb[1].float(), runs[0][2], rtol=0.1, atol=0.02)


def test_bias_combinations_and_refusals():
    """GLM-4.5 (attention_bias: q/k/v only) = model.qkv_bias true without model.bias; the output
    bias follows model.attention_output_bias (null = model.bias); one-line refusals."""
    glm = _attention(_model_config(attention_sinks=False, sliding_window=None, layer_types=None,
                                   attention_output_bias=None), 0)
    assert glm.qkv.bias is not None and glm.proj.bias is None and glm.sinks is None and glm.window is None
    gpt2_no_out = _attention(_model_config(bias=True, qkv_bias=None, attention_output_bias=False), 0)
    assert gpt2_no_out.qkv.bias is not None and gpt2_no_out.proj.bias is None
    assert _attention(_model_config(bias=True, attention_output_bias=None), 0).proj.bias is not None
    with pytest.raises(ConfigError, match="needs causal attention"):
        _attention(_model_config(), 0, causal=False)
    _attention(_model_config(), 1, causal=False)  # a full_attention layer of a bidirectional model: no window
    bad = {"sliding_window": (0, "must be >= 1"), "layer_types": (["sliding_attention"], "has 1 entries"),
           "moe.activation": ("swish", "must be null"), "moe.swiglu_limit": (0.0, "must be > 0")}
    for key, (value, message) in bad.items():
        cfg = _model_config()
        section, name = key.split(".") if "." in key else ("model", key)
        setattr(getattr(cfg, section), name, value)
        with pytest.raises(ConfigError, match=message):
            validate_config(cfg, 1)
    cfg = _model_config(sliding_window=None)
    with pytest.raises(ConfigError, match="needs model.sliding_window"):
        validate_config(cfg, 1)
    cfg = _model_config(layer_types=["sliding_attention", "chunked_attention"])
    with pytest.raises(ConfigError, match="chunked_attention"):
        validate_config(cfg, 1)


def _moe_config() -> Config:
    cfg = Config()
    cfg.model.hidden_size, cfg.model.activation, cfg.model.bias = H, "swiglu", False
    moe = cfg.moe
    moe.num_experts, moe.top_k, moe.expert_ffn_hidden_size, moe.aux_loss_coeff = E, K, F, 0.0
    moe.router_bias, moe.expert_proj_bias, moe.activation, moe.swiglu_limit = True, True, "swiglu_oss", LIMIT
    moe.norm_topk_prob = True  # gpt-oss's softmax over the selected logits (router.py docstring)
    return cfg


def test_moe_layer_equals_gpt_oss_mlp():
    """Router bias, expert biases (without model.bias), clamped SwiGLU and the top-k softmax:
    MoELayer == GptOssMLP (router + experts), output and every gradient; the clamp is active."""
    config = _hf_config()
    theirs = hf.GptOssMLP(config)
    layer = MoELayer(_moe_config(), SINGLE, layer_index=0)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        gate_up, gate_up_bias = theirs.experts.gate_up_proj, theirs.experts.gate_up_proj_bias
        layer.router.weight.copy_(theirs.router.weight)
        layer.router.bias.copy_(theirs.router.bias)
        # transformers interleaves (gate, up) columns; ours are the halves [.., 2, f]
        layer.experts.w1.copy_(torch.stack([gate_up[..., ::2], gate_up[..., 1::2]], dim=2))
        layer.experts.b1.copy_(torch.stack([gate_up_bias[..., ::2], gate_up_bias[..., 1::2]], dim=1))
        layer.experts.w2.copy_(theirs.experts.down_proj)
        layer.experts.b2.copy_(theirs.experts.down_proj_bias)
    x = torch.randn(B, S, H, generator=gen)
    x_ours, x_theirs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    hidden = x.reshape(-1, H) @ gate_up.detach()[0] + gate_up_bias.detach()[0]
    assert (hidden[:, ::2] > LIMIT).any() and (hidden[:, 1::2].abs() > LIMIT).any()  # both clamps bite
    y_ours, _ = layer(x_ours)
    y_theirs, _ = theirs(x_theirs)
    torch.testing.assert_close(y_ours, y_theirs, **TOL)
    ours_p = [x_ours, layer.router.weight, layer.router.bias, layer.experts.w1, layer.experts.b1, layer.experts.w2,
              layer.experts.b2]
    theirs_p = [x_theirs, theirs.router.weight, theirs.router.bias, gate_up, gate_up_bias, theirs.experts.down_proj,
                theirs.experts.down_proj_bias]
    for y in (y_ours, y_theirs):  # backward(): the experts' w1 / w2 gradients go straight into .grad
        (y * torch.linspace(-1, 1, y.numel()).view(y.shape)).sum().backward()
    for name, a, b in zip(["x", "router.weight", "router.bias", "w1", "b1", "w2", "b2"], [p.grad for p in ours_p],
                          [p.grad for p in theirs_p]):
        if name in ("w1", "b1"):
            b = torch.stack([b[..., ::2], b[..., 1::2]], dim=-2)
        torch.testing.assert_close(a, b, **TOL, msg=name)


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_top_k_softmax_of_selected_logits_is_norm_topk_prob(top_k):
    """GptOssTopKRouter's softmax over the k selected logits == softmax over all, top-k, renormalized."""
    config = _hf_config(num_experts_per_tok=top_k)
    router = hf.GptOssTopKRouter(config)
    gen = torch.Generator().manual_seed(top_k)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=gen))
        router.bias.copy_(torch.randn(E, generator=gen))
    x = torch.randn(64, H, generator=gen)
    logits, scores, indices = router(x)
    _, expert_ids, weights = top_k_gating(logits, top_k, norm_topk_prob=True)
    assert torch.equal(expert_ids, indices)
    torch.testing.assert_close(weights, scores, rtol=1e-6, atol=1e-7)


OSS = ["model.bias=false", "model.activation=swiglu", "model.qkv_bias=true", "model.attention_output_bias=true",
       "model.attention_sinks=true", "model.sliding_window=4", "model.layer_types=[sliding_attention,full_attention]",
       "moe.router_bias=true", "moe.expert_proj_bias=true", "moe.activation=swiglu_oss", "moe.swiglu_limit=1.0"]


def test_gpt_oss_model_compile_recompute_lancet_exact():
    """The tiny GPT-MoE with every gpt-oss key (dropout 0.1 through the sinks' explicit softmax,
    capacity drops): compile, full / selective recomputation and Lancet's batch parts (router bias
    under GatePartition) give the plain run's losses and gradients."""
    from tests.tiny_model import assert_same_steps, tiny_model_steps

    plain = tiny_model_steps(OSS, steps=2)
    assert sum(plain[0].dropped) > 0
    assert all(plain[0].grads[f"layers.{i}.attention.sinks"].abs().sum() > 0 for i in range(2))
    for extra in (["training.compile=true"], ["training.recompute=full"], ["training.recompute=selective"],
                  ["moe.lancet.partitions=2"]):
        assert_same_steps(tiny_model_steps(OSS + extra, steps=2), plain, f"gpt-oss {extra}")
