"""Hugging Face gpt-oss checkpoints (convert/hf_gpt_oss.py), both ways, checked against transformers.

A tiny random `GptOssForCausalLM` (sinks, q/k/v/o biases, alternating sliding window shorter than the
sequence, YaRN, biased router and experts, clamped SwiGLU; every weight perturbed): import -> our
logits equal transformers' (fp32, 1e-4); export -> the same tensors bit for bit, from the checkpoint
and from its tensor 2 x expert 2 reshard, and `from_pretrained` of the export gives the same logits.
The published MXFP4 experts: our dequantization equals transformers' on random blocks and scales,
and a checkpoint whose experts are MXFP4 imports to exactly the dequantized weights. The published
gpt-oss-20b / 120b `config.json` values give transformers' parameter count (both on the meta device)."""
import json

import pytest
import torch

from megatron_moe import load_model
from megatron_moe.config import load_config
from megatron_moe.convert import offline
from megatron_moe.convert.hf_common import INDEX
from megatron_moe.convert.hf_families import family_of
from megatron_moe.convert.hf_gpt_oss import FP4_VALUES, dequantize_mxfp4
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.gpt import GPTMoEModel
from tests.checkpoint_helpers import hf_tensors, random_hf_model
from tests.unit.test_hf_families import MIXTRAL_8X7B

transformers = pytest.importorskip("transformers")
mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
TOKENS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))  # 12 > sliding_window 4
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 16}
TINY = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
            max_position_embeddings=64, rms_norm_eps=1e-5, swiglu_limit=7.0, rope_parameters=YARN)


def _logits(model, tokens=TOKENS):
    with torch.no_grad():
        out = model(tokens)
        return out.logits if hasattr(out, "logits") else out


def test_round_trip_and_logits(tmp_path):
    hf = random_hf_model("GptOssConfig", "GptOssForCausalLM", TINY, tmp_path / "hf")
    assert hf.config.layer_types == ["sliding_attention", "full_attention"]
    offline.import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    ours = load_model(str(tmp_path / "ours"))
    expected = _logits(hf)
    assert (_logits(ours) - expected).abs().max().item() < 1e-4
    offline.export_hf(str(tmp_path / "ours"), str(tmp_path / "out"), max_shard_bytes=64 << 10)  # family guessed
    assert len(set(json.loads((tmp_path / "out" / INDEX).read_text())["weight_map"].values())) > 1
    original, exported = hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "out")
    assert original.keys() == exported.keys() and all(torch.equal(original[k], exported[k]) for k in original)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "gpt_oss" and "quantization_config" not in config  # unquantized export
    reloaded = transformers.GptOssForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    assert (_logits(reloaded) - expected).abs().max().item() < 1e-4
    resharded = offline.reshard(str(tmp_path / "ours"), str(tmp_path / "tp2ep2"), 2, 2, 1)
    offline.export_hf(resharded, str(tmp_path / "out2"), family="gpt_oss")
    again = hf_tensors(tmp_path / "out2")
    assert again.keys() == original.keys() and all(torch.equal(original[k], again[k]) for k in original)


def test_the_sliding_window_and_sinks_matter(tmp_path):
    """The logits test above is not vacuous: without the window, or with zero sinks, they differ."""
    hf = random_hf_model("GptOssConfig", "GptOssForCausalLM", TINY, tmp_path / "hf")
    offline.import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    expected = _logits(hf)
    unwindowed = offline.import_hf(str(tmp_path / "hf"), str(tmp_path / "full"),
                                   overrides=["model.sliding_window=null", "model.layer_types=null"])
    assert (_logits(load_model(unwindowed)) - expected).abs().max().item() > 1e-3
    ours = load_model(str(tmp_path / "ours"))
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith("attention.sinks"):
                p.zero_()
    assert (_logits(ours) - expected).abs().max().item() > 1e-3


def quantize_mxfp4(w):
    """The inverse of the published scheme (test only): HF weight [E, K, R] -> blocks [E, R, K/32, 16],
    scales [E, R, K/32], per block of 32 the smallest power-of-two scale that fits |w| <= 6 x scale,
    each value rounded to the nearest FP4 E2M1 value, low nibble first."""
    e, k, r = w.shape
    t = w.transpose(1, 2).reshape(e, r, k // 32, 32)
    exp = torch.ceil(torch.log2(t.abs().amax(-1).clamp_min(2.0 ** -100) / 6)).clamp(-127, 127)
    codes = ((t / torch.exp2(exp)[..., None]).unsqueeze(-1) - torch.tensor(FP4_VALUES)).abs().argmin(-1)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8), (exp + 127).to(torch.uint8)


def test_mxfp4_dequantization_equals_transformers():
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), generator=g, dtype=torch.uint8)
    for scales in (torch.randint(0, 256, (3, 8, 4), generator=g, dtype=torch.uint8),  # every exponent (inf past 2^128)
                   torch.randint(110, 135, (3, 8, 4), generator=g, dtype=torch.uint8)):
        for dtype in (torch.bfloat16, torch.float32):
            theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)
            ours = dequantize_mxfp4(blocks, scales, dtype)
            assert ours.dtype == theirs.dtype and ours.shape == theirs.shape == (3, 128, 8)
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)
    w = torch.randn(2, 64, 32, generator=g)
    assert torch.equal(mxfp4.convert_moe_packed_tensors(*quantize_mxfp4(w), dtype=torch.float32),
                       dequantize_mxfp4(*quantize_mxfp4(w), torch.float32))
    assert (dequantize_mxfp4(*quantize_mxfp4(w), torch.float32) - w).abs().max() < 0.5 * w.abs().max()


def test_mxfp4_experts_import_dequantized(tmp_path, capsys):
    from safetensors.torch import save_file

    hf = random_hf_model("GptOssConfig", "GptOssForCausalLM", TINY, tmp_path / "hf")
    tensors, quantized = hf_tensors(tmp_path / "hf"), tmp_path / "mxfp4"
    quantized.mkdir()
    dequantized = {}
    for name in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(name))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        dequantized[name] = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # transformers'
    save_file(tensors, str(quantized / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (quantized / "config.json").write_text(json.dumps(config))
    offline.import_hf(str(quantized), str(tmp_path / "ours"))
    assert capsys.readouterr().err.count("MXFP4") == 1  # said once
    ours = load_model(str(tmp_path / "ours"))
    params = dict(ours.model.named_parameters())
    for i in range(TINY["num_hidden_layers"]):
        gate_up, down = (dequantized[f"model.layers.{i}.mlp.experts.{p}"].float() for p in ("gate_up_proj", "down_proj"))
        w1, w2 = params[f"layers.{i}.ffn.experts.w1"], params[f"layers.{i}.ffn.experts.w2"]  # [E, h, 2, f], [E, f, h]
        assert torch.equal(w1.transpose(-1, -2).flatten(-2), gate_up) and torch.equal(w2, down)  # exactly
    with torch.no_grad():  # transformers' model with the same dequantized experts: the same logits
        for name, value in dequantized.items():
            hf.get_parameter(name).copy_(value.float())
    assert (_logits(ours) - _logits(hf)).abs().max().item() < 1e-4


def _layer_types(n):
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]


GPT_OSS_20B = {  # openai/gpt-oss-20b config.json
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": _layer_types(24), "max_position_embeddings": 131072, "num_attention_heads": 64,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
    "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088}
GPT_OSS_120B = dict(GPT_OSS_20B, num_hidden_layers=36, num_local_experts=128, layer_types=_layer_types(36))


@pytest.mark.parametrize("hf,published", [(GPT_OSS_20B, 20.9e9), (GPT_OSS_120B, 116.8e9)], ids=["20b", "120b"])
def test_real_configs_import_with_the_published_parameter_count(hf, published):
    cfg = load_config(None, family_of("gpt_oss").overrides(hf) + offline.SINGLE)
    assert (cfg.model.sliding_window, cfg.model.rope_scaling.type, cfg.model.rope_scaling.factor,
            cfg.model.rope_scaling.truncate, cfg.model.rope_theta) == (128, "yarn", 32.0, False, 150000.0)
    unquantized = {k: v for k, v in hf.items() if k != "quantization_config"}  # transformers builds bf16 experts
    with torch.device("meta"):
        ours = sum(p.numel() for p in GPTMoEModel(cfg, ParallelState.single_process()).parameters())
        theirs = sum(p.numel() for p in transformers.GptOssForCausalLM(transformers.GptOssConfig(**unquantized)).parameters())
    assert ours == theirs and abs(ours - published) < 0.05e9, (ours, theirs)


@pytest.mark.parametrize("field,value", [("quantization_config", {"quant_method": "gptq"}), ("swiglu_alpha", 1.0),
                                         ("layer_types", ["chunked_attention"] * 24),
                                         ("rope_scaling", {"rope_type": "llama3", "factor": 8.0})])
def test_unsupported_fields_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        family_of("gpt_oss").overrides(dict(GPT_OSS_20B, **{field: value}))


def test_what_gpt_oss_lacks_is_refused_on_export():
    from megatron_moe.convert.hf_common import check_shape

    cfg = load_config(None, family_of("gpt_oss").overrides(GPT_OSS_20B) + offline.SINGLE)
    check_shape(family_of("gpt_oss"), cfg)
    for override, key in (("model.attention_sinks=false", "model.attention_sinks"), ("moe.router_bias=false", "moe.router_bias"),
                          ("moe.activation=swiglu", "moe.activation"), ("model.qk_norm=head", "model.qk_norm"),
                          ("model.attention_output_bias=false", "model.attention_output_bias")):
        bad = load_config(None, family_of("gpt_oss").overrides(GPT_OSS_20B) + offline.SINGLE + [override])
        with pytest.raises(ValueError, match=key):
            check_shape(family_of("gpt_oss"), bad)
    mixtral = family_of("mixtral").overrides(MIXTRAL_8X7B) + offline.SINGLE  # the other families refuse gpt-oss's keys
    for override in ("model.attention_sinks=true", "model.sliding_window=8", "moe.router_bias=true",
                     "moe.expert_proj_bias=true", "moe.activation=swiglu_oss", "model.attention_output_bias=true",
                     "model.rope_scaling.type=yarn"):
        with pytest.raises(ValueError, match=override.split("=")[0]):
            check_shape(family_of("mixtral"), load_config(None, mixtral + [override]))
