"""Issue #45 items 7-8 for `deepseek_v3` and `glm4_moe` (convert/hf_deepseek.py).

Tiny random models built by transformers (every weight and the `e_score_correction_bias` buffers
perturbed) in each flag combination that changes the mapping: import -> our logits equal
transformers' (fp32, 1e-4); export -> the same tensors bit for bit (a `rope_interleave: false`
checkpoint comes back interleaved: its rope rows permuted, the same logits), also from a tensor 2 x
expert 2 resharded checkpoint. MTP layers (which transformers does not build) are appended from a
model one layer deeper; our MTP head's logits equal a reference built from that transformers
decoder layer and the MTP norms / projection. The published DeepSeek-V3 and GLM-4.5-Air
config.json values give our model transformers' parameter count (+ the expert-bias buffers), both
on the meta device."""
import json

import pytest
import torch

from megatron_moe import load_model
from megatron_moe.config import load_config, validate_config
from megatron_moe.convert import offline
from megatron_moe.convert.hf_common import INDEX
from megatron_moe.convert.hf_families import family_of
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.gpt import GPTMoEModel
from megatron_moe.model.mtp import shifted
from tests.checkpoint_helpers import hf_tensors

transformers = pytest.importorskip("transformers")
TOKENS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
SMALL = dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=64,
             rms_norm_eps=1e-6, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
             num_experts_per_tok=3, n_shared_experts=2, norm_topk_prob=True, routed_scaling_factor=2.5,
             n_group=4, topk_group=2, first_k_dense_replace=1, num_nextn_predict_layers=1, attention_dropout=0.0)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}
MLA = dict(num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12)
CASES = {  # name: (family, config, MTP layers appended)
    "deepseek_qlora_interleave_yarn_mtp": ("deepseek_v3", dict(MLA, q_lora_rank=24, rope_interleave=True,
                                                               rope_parameters=YARN), True),
    "deepseek_noqlora_plain_rope_dense0": ("deepseek_v3", dict(MLA, q_lora_rank=None, rope_interleave=False,
                                                               first_k_dense_replace=0, n_group=1, topk_group=1,
                                                               rope_parameters={"rope_type": "default",
                                                                                "rope_theta": 5e4}), False),
    "glm_qknorm_bias_mtp": ("glm4_moe", dict(num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5,
                                             attention_bias=True, use_qk_norm=True), True),
    "glm_plain_dense0": ("glm4_moe", dict(num_key_value_heads=2, head_dim=8, partial_rotary_factor=0.5,
                                          attention_bias=False, use_qk_norm=False, first_k_dense_replace=0,
                                          n_group=1, topk_group=1, rope_parameters={"rope_type": "default",
                                                                                     "rope_theta": 1e6}), False),
}
CLASSES = {"deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
           "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM")}


def _build(family, config, layers):
    """A transformers model of `layers` layers from seed 0, every parameter and expert-bias buffer
    perturbed; eager attention, eval mode."""
    config_cls, model_cls = CLASSES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**dict(config, num_hidden_layers=layers))
    model = getattr(transformers, model_cls)(config)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.05)
    return model.eval()


def _save_with_mtp(family, config, path):
    """The model saved to `path`, and with `mtp` a deeper model whose last layer is stored as MTP layer
    L = num_hidden_layers (+ enorm, hnorm, eh_proj, shared_head.norm, and copies of the embedding and
    head) in the same safetensors file. Returns (model, deeper model, MTP extras) ."""
    from safetensors.torch import load_file, save_file

    family_name, hf, mtp = CASES[family]
    layers = SMALL["num_hidden_layers"]
    model = _build(family_name, dict(SMALL, **hf), layers)
    model.save_pretrained(path)
    if not mtp:
        return model, None, None
    deeper = _build(family_name, dict(SMALL, **hf), layers + 1)
    deeper.save_pretrained(path / "deeper")
    tensors = load_file(str(path / "model.safetensors"))
    prefix = f"model.layers.{layers}."
    deeper_tensors = load_file(str(path / "deeper" / "model.safetensors"))
    tensors.update({k: v for k, v in deeper_tensors.items() if k.startswith(prefix)})
    g, h = torch.Generator().manual_seed(5), SMALL["hidden_size"]
    extras = {"enorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
              "hnorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
              "eh_proj.weight": 0.1 * torch.randn(h, 2 * h, generator=g),
              "shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=g)}
    tensors.update({prefix + k: v for k, v in extras.items()})
    tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return model, deeper, extras


def _mtp_reference(model, deeper, extras, tokens):
    """Depth-1 MTP logits (model/mtp.py): h_0 = transformers' final normed hidden states; the MTP
    block is the deeper model's last decoder layer with its rotary tables and a causal mask."""
    eps = SMALL["rms_norm_eps"]

    def norm(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    h0 = model.model(tokens).last_hidden_state
    emb = model.model.embed_tokens(shifted(tokens, 1))
    x = torch.nn.functional.linear(torch.cat([norm(emb, extras["enorm.weight"]), norm(h0, extras["hnorm.weight"])], -1),
                                   extras["eh_proj.weight"])
    s = tokens.shape[1]
    position_ids = torch.arange(s)[None]
    mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
    x = deeper.model.layers[-1](x, attention_mask=mask, position_ids=position_ids,
                                position_embeddings=deeper.model.rotary_emb(x, position_ids))
    return model.lm_head(norm(x, extras["shared_head.norm.weight"]))


def _our_mtp_logits(ours, tokens):
    gpt, captured = ours.model, {}
    handle = gpt.final_norm.register_forward_hook(lambda mod, inp, out: captured.setdefault("h0", out))
    gpt(tokens)
    handle.remove()
    hidden, _ = gpt.mtp[0](captured["h0"], gpt._embed_words(shifted(tokens, 1)))
    return gpt.gather_logits(gpt._logits(hidden))


def _interleaved_copy(original, name, family, hf):
    """`original[name]` as an interleaved (rope_interleave: true) export writes a rope_interleave:
    false checkpoint's rope rows: pairs (i, i + r/2) -> (2i, 2i + 1)."""
    t, r = original[name], hf.get("qk_rope_head_dim", 0)
    back = torch.argsort(torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2)]))
    if name.endswith(("q_b_proj.weight", "q_proj.weight")) and family == "deepseek_v3":
        per = t.view(SMALL["num_attention_heads"], -1, t.shape[-1])
        return torch.cat([per[:, :-r], per[:, -r:][:, back]], 1).reshape(t.shape)
    if name.endswith("kv_a_proj_with_mqa.weight"):
        return torch.cat([t[:-r], t[-r:][back]])
    return t


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_logits_and_mtp(case, tmp_path):
    family, hf, mtp = CASES[case]
    model, deeper, extras = _save_with_mtp(case, hf, tmp_path / "hf")
    offline.import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    ours = load_model(str(tmp_path / "ours"))
    assert ours.cfg.model.mtp_depth == (1 if mtp else 0)
    with torch.no_grad():
        expected = model(TOKENS).logits
        assert (ours(TOKENS) - expected).abs().max().item() < 1e-4
        if mtp:
            assert (_our_mtp_logits(ours, TOKENS) - _mtp_reference(model, deeper, extras, TOKENS)).abs().max() < 1e-4
    offline.export_hf(str(tmp_path / "ours"), str(tmp_path / "out"), family=family, max_shard_bytes=64 << 10)
    index = json.loads((tmp_path / "out" / INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 1  # streamed into several shards
    original, exported = hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "out")
    assert original.keys() == exported.keys()
    want = {k: _interleaved_copy(original, k, family, hf) if hf.get("rope_interleave") is False else original[k]
            for k in original}
    assert [k for k in original if not torch.equal(want[k], exported[k])] == []
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == family and config["num_nextn_predict_layers"] == (1 if mtp else 0)
    reloaded = getattr(transformers, CLASSES[family][1]).from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    with torch.no_grad():
        assert (reloaded.eval()(TOKENS).logits - expected).abs().max().item() < 1e-4
    # a checkpoint in another layout (chunks of tensor 2 x expert 2) exports the same tensors
    resharded = offline.reshard(str(tmp_path / "ours"), str(tmp_path / "tp2ep2"), 2, 2, 1)
    offline.export_hf(resharded, str(tmp_path / "out2"))  # the family from the shape
    again = hf_tensors(tmp_path / "out2")
    assert again.keys() == original.keys() and all(torch.equal(exported[k], again[k]) for k in original)


def test_mtp_left_out_on_request_and_differing_copies_refused(tmp_path, capsys):
    _save_with_mtp("glm_qknorm_bias_mtp", CASES["glm_qknorm_bias_mtp"][1], tmp_path / "hf")
    offline.import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"), overrides=["model.mtp_depth=0"])
    assert "leaving out 1 MTP module" in capsys.readouterr().err
    assert load_model(str(tmp_path / "ours")).cfg.model.mtp_depth == 0
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    tensors["model.layers.3.embed_tokens.weight"] += 1.0
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.3.embed_tokens.weight differs from model.embed_tokens.weight"):
        offline.import_hf(str(tmp_path / "hf"), str(tmp_path / "ours2"))


DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3 config.json (quantization_config, auto_map left out)
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                            "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280}
GLM45_AIR = {  # zai-org/GLM-4.5-Air config.json
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True, "attention_dropout": 0.0,
    "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "partial_rotary_factor": 0.5, "initializer_range": 0.02, "intermediate_size": 10944,
    "max_position_embeddings": 131072, "moe_intermediate_size": 1408, "norm_topk_prob": True,
    "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 128, "n_shared_experts": 1,
    "routed_scaling_factor": 1.0, "num_experts_per_tok": 8, "first_k_dense_replace": 1, "num_hidden_layers": 46,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000,
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_qk_norm": False, "vocab_size": 151552}
GLM45 = dict(GLM45_AIR, hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536, n_routed_experts=160,
             routed_scaling_factor=2.5, first_k_dense_replace=3, num_hidden_layers=92, use_qk_norm=True)  # zai-org/GLM-4.5


@pytest.mark.parametrize("hf,published", [(DEEPSEEK_V3, 671e9), (GLM45_AIR, 106e9), (GLM45, 355e9)],
                         ids=["deepseek_v3", "glm45_air", "glm45"])
def test_real_configs_give_transformers_parameter_count(hf, published):
    """MTP off on our side: transformers builds no MTP module. Our expert bias is a frozen parameter,
    transformers' e_score_correction_bias a buffer: counted on both sides. The imported config
    validates as it is (the published context length included)."""
    cfg = load_config(None, family_of(hf["model_type"]).overrides(hf) + offline.SINGLE + ["model.mtp_depth=0"])
    validate_config(cfg, 1)
    config_cls, model_cls = CLASSES[hf["model_type"]]
    with torch.device("meta"):
        ours = sum(p.numel() for p in GPTMoEModel(cfg, ParallelState.single_process()).parameters())
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**hf))
        theirs = sum(p.numel() for p in model.parameters())
        biases = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert biases == hf["n_routed_experts"] * (hf["num_hidden_layers"] - hf["first_k_dense_replace"])
    assert ours == theirs + biases, (ours, theirs, biases)
    with torch.device("meta"):
        trainable = sum(p.numel() for p in GPTMoEModel(cfg, ParallelState.single_process()).parameters() if p.requires_grad)
    assert trainable == theirs, (trainable, theirs)  # exactly: the expert biases are not trained by gradients
    assert abs(ours - published) < 0.05 * published, ours


@pytest.mark.parametrize("family,field,value", [
    ("deepseek_v3", "attention_bias", True), ("deepseek_v3", "scoring_func", "softmax"),
    ("deepseek_v3", "topk_method", "greedy"), ("deepseek_v3", "moe_layer_freq", 2),
    ("deepseek_v3", "quantization_config", {"quant_method": "bitsandbytes"}),
    ("deepseek_v3", "quantization_config", {"quant_method": "fp8", "fmt": "e5m2"}), ("deepseek_v3", "n_shared_experts", 0),
    ("deepseek_v3", "num_key_value_heads", 8), ("glm4_moe", "rope_scaling", {"rope_type": "yarn", "factor": 4.0}),
    ("glm4_moe", "sliding_window", 4096)])
def test_unsupported_fields_are_refused_by_name(family, field, value):
    hf = dict(DEEPSEEK_V3 if family == "deepseek_v3" else GLM45_AIR, **{field: value})
    if field == "sliding_window":
        hf["use_sliding_window"] = True
    with pytest.raises(ValueError, match=field.split("_")[0] if field == "rope_scaling" else field):
        family_of(family).overrides(hf)


@pytest.mark.parametrize("config", ["deepseek_v3_tiny", "glm45_tiny"])
def test_dense_model_of_the_family_upcycles_to_the_same_function(config, tmp_path):
    """A dense model of the family's shape (MLA or partial rotary + q/k/v biases, an MTP module) upcycled
    to 8 experts computes the dense function (sigmoid scores renormalized, scale 1: the weights sum
    to one); the first `moe.first_k_dense` layers stay dense, the expert biases start at zero."""
    from megatron_moe.inference import build_single_process_model

    dense = load_config(f"configs/{config}.yaml", offline.SINGLE + [
        "moe.layer_freq=4", "moe.shared_expert_ffn_hidden_size=null", "moe.topk_scaling_factor=1.0",
        "moe.router_groups=1", "moe.router_group_topk=null", f"training.run_dir={tmp_path}/run"])
    weights = {n: p.detach() + 0.01 for n, p in build_single_process_model(dense).named_parameters()}
    offline.write_model_checkpoint(str(tmp_path / "dense"), dense, weights)
    offline.upcycle(str(tmp_path / "dense"), 8, str(tmp_path / "moe"))
    before, after = load_model(str(tmp_path / "dense")), load_model(str(tmp_path / "moe"))
    assert [layer.is_moe for layer in after.model.layers] == [False, True] and after.model.mtp[0].layer.is_moe
    with torch.no_grad():
        assert (before(TOKENS) - after(TOKENS)).abs().max().item() < 1e-5


def test_export_streams_one_layer_or_mtp_module_at_a_time(tmp_path, monkeypatch):
    """export-hf reads each MTP module like a layer, on its own (DeepSeek-V3's layer 61 is as big as
    any layer): no read holds two layers / MTP modules, the outer read none; the copies are exported."""
    from megatron_moe.inference import build_single_process_model

    cfg = load_config("configs/deepseek_v3_tiny.yaml", offline.SINGLE + ["model.mtp_depth=2", f"training.run_dir={tmp_path}"])
    weights = {n: p.detach() + 0.01 for n, p in build_single_process_model(cfg).named_parameters()}
    offline.write_model_checkpoint(str(tmp_path / "ours"), cfg, weights)
    reads, load_full = [], offline.load_full
    monkeypatch.setattr(offline, "load_full", lambda path, keys: reads.append(keys) or load_full(path, keys))
    offline.export_hf(str(tmp_path / "ours"), str(tmp_path / "out"))
    modules = [{".".join(k.split(".")[:2]) for k in keys if k.startswith(("model/layers.", "model/mtp."))} for keys in reads]
    assert all(len(m) <= 1 for m in modules), modules
    assert sorted(m.pop() for m in modules if m) == ["model/layers.0", "model/layers.1", "model/mtp.0", "model/mtp.1"]
    exported = hf_tensors(tmp_path / "out")
    assert torch.equal(exported["model.layers.3.eh_proj.weight"], weights["mtp.1.eh_proj.weight"])
    assert torch.equal(exported["model.layers.3.shared_head.head.weight"], weights["output.weight"])


def test_kimi_k2_imports_as_deepseek_v3():
    """moonshotai/Kimi-K2-Instruct's config.json (model_type kimi_k2, DeepseekV3ForCausalLM through its
    remote code) is DeepSeek-V3's shape: it imports into transformers' DeepseekV3 parameter count."""
    from megatron_moe.convert.hf_families import import_family_of

    hf = dict(DEEPSEEK_V3, model_type="kimi_k2", first_k_dense_replace=1, max_position_embeddings=131072, n_group=1,
              topk_group=1, n_routed_experts=384, num_attention_heads=64, num_key_value_heads=64,
              num_nextn_predict_layers=0, routed_scaling_factor=2.827, rope_theta=50000.0, vocab_size=163840,
              rope_scaling={"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 4096, "type": "yarn"},
              quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                   "weight_block_size": [128, 128]})
    family = import_family_of("kimi_k2")
    assert family is family_of("deepseek_v3")
    cfg = load_config(None, family.overrides(hf) + offline.SINGLE + ["model.seq_length=4096"])
    validate_config(cfg, 1)
    unquantized = {k: v for k, v in hf.items() if k not in ("quantization_config", "model_type")}
    with torch.device("meta"):
        ours = sum(p.numel() for p in GPTMoEModel(cfg, ParallelState.single_process()).parameters() if p.requires_grad)
        theirs = sum(p.numel() for p in transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**unquantized)).parameters())
    assert ours == theirs and abs(ours - 1.03e12) < 0.03e12, ours


@pytest.mark.parametrize("top,own", [(8192, 4096), (None, 4096), (None, None)], ids=["top_level", "own", "absent"])
def test_yarn_original_context_as_transformers_reads_it(top, own):
    """YaRN's `original_max_position_embeddings`: a top-level key wins over rope_scaling's, an absent one
    is `max_position_embeddings` (transformers' standardize_rope_params, run again when the rotary
    tables are built): our inverse frequencies and attention factor equal transformers'."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from megatron_moe.model.rotary import inverse_frequencies

    rope = {k: v for k, v in DEEPSEEK_V3["rope_scaling"].items() if k != "original_max_position_embeddings"}
    hf = dict(DEEPSEEK_V3, rope_scaling=dict(rope, **({} if own is None else {"original_max_position_embeddings": own})),
              **({} if top is None else {"original_max_position_embeddings": top}))
    cfg = load_config(None, family_of("deepseek_v3").overrides(hf) + offline.SINGLE)
    config = transformers.DeepseekV3Config(**{k: v for k, v in hf.items() if k != "model_type"})
    theirs, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    ours = inverse_frequencies(hf["qk_rope_head_dim"], cfg.model.rope_theta, cfg.model.rope_scaling)
    assert torch.equal(ours[0], theirs) and ours[1] == factor
    assert cfg.model.rope_scaling.original_max_position_embeddings == (top or own or hf["max_position_embeddings"])
