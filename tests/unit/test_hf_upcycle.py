"""Upcycling dense Hugging Face checkpoints (convert/hf_dense.py, offline.import_hf / upcycle).

For each dense family a tiny random model built locally by `transformers` (config shaped like a
released one, every weight perturbed off its init), upcycled by `import_hf(..., num_experts=N)`:
our logits equal the dense model's (fp32, 1e-4), the checkpoint exports to the MoE family, and
`from_pretrained` of that class gives the dense model's logits too, with every expert's tensors
equal to the dense FFN's, the rest equal to the dense model's, and every expert chosen by some
token (the equality does not rest on one expert). The two-step path (import the dense model,
then `upcycle`) through tools/convert_checkpoint.py with top-1 routing, and the refusals, one
line naming the field."""
import json
import subprocess
import sys

import pytest
import torch

from megatron_moe import load_model
from megatron_moe.convert import offline
from megatron_moe.convert.hf_families import import_family_of
from tests.checkpoint_helpers import hf_tensors, random_hf_model

transformers = pytest.importorskip("transformers")
TOKENS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(2))
SMALL = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
             rms_norm_eps=1e-6)
DENSE = {  # released shapes, scaled down: (config, class, extra config, MoE family, MoE class)
    # Llama-3-8B: 32 heads, 8 kv heads
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, intermediate_size=48),
              "mixtral", "MixtralForCausalLM"),
    # Mistral-7B-v0.3: 32 heads, 8 kv heads, no sliding window
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2, intermediate_size=48,
                                                           sliding_window=None), "mixtral", "MixtralForCausalLM"),
    # Qwen3-0.6B: 16 heads, 8 kv heads, head_dim 128 apart from hidden / heads, QK-norm, tied embeddings
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=16, intermediate_size=48,
                                                     tie_word_embeddings=True), "qwen3_moe", "Qwen3MoeForCausalLM"),
}


def _dense_model(family, path):
    config_cls, model_cls, extra, _, _ = DENSE[family]
    return random_hf_model(config_cls, model_cls, dict(SMALL, **extra), path)


def _exported_logits(ckpt, out, family):
    offline.export_hf(str(ckpt), str(out))
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == DENSE[family][3] and config["architectures"] == [DENSE[family][4]]
    moe = getattr(transformers, DENSE[family][4]).from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        return moe(TOKENS).logits, config


@pytest.mark.parametrize("family", list(DENSE))
def test_upcycled_dense_model_equals_it(family, tmp_path):
    dense = _dense_model(family, tmp_path / "dense")
    offline.import_hf(str(tmp_path / "dense"), str(tmp_path / "ours"), num_experts=4, top_k=2)
    ours = load_model(str(tmp_path / "ours"))
    assert len(ours.model.moe_layers()) == 2 and ours.cfg.moe.num_experts == 4 and ours.cfg.moe.top_k == 2
    picks = []
    for layer in ours.model.moe_layers():  # the experts each token goes to, as routed
        layer.router.register_forward_hook(lambda module, args, routing: picks.append(routing.expert_ids))
    with torch.no_grad():
        expected = dense(TOKENS).logits
        assert (ours(TOKENS) - expected).abs().max().item() < 1e-4
    assert len(picks) == 2 and all(torch.bincount(p.ravel(), minlength=4).min() > 0 for p in picks)  # all 4 used
    theirs, config = _exported_logits(tmp_path / "ours", tmp_path / "moe", family)
    assert (theirs - expected).abs().max().item() < 1e-4, family
    assert config["num_experts_per_tok"] == 2 and config["num_key_value_heads"] == 2
    original, exported = hf_tensors(tmp_path / "dense"), hf_tensors(tmp_path / "moe")
    moe_prefix, (gate, up, down) = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
                                    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"))}[DENSE[family][3]]
    for i in range(2):
        for j in range(4):
            for ours_name, dense_name in ((gate, "gate_proj"), (up, "up_proj"), (down, "down_proj")):
                assert torch.equal(exported[f"model.layers.{i}.{moe_prefix}.experts.{j}.{ours_name}.weight"],
                                   original[f"model.layers.{i}.mlp.{dense_name}.weight"])
    shared = [k for k in original if ".mlp." not in k]  # attention, norms, embeddings as they were
    assert shared and all(torch.equal(exported[k], original[k]) for k in shared)


def test_import_dense_then_upcycle_top1(tmp_path):
    """The two steps through the command line: the dense model as it is (every layer dense), then
    `upcycle --top-k 1` (norm_topk_prob from the dense import: the one weight is 1)."""
    dense = _dense_model("qwen3", tmp_path / "dense")
    tool = [sys.executable, "tools/convert_checkpoint.py"]
    run = subprocess.run(tool + ["import-hf", "--input", str(tmp_path / "dense"), "--output", str(tmp_path / "ours")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    ours = load_model(str(tmp_path / "ours"))
    with torch.no_grad():
        expected = dense(TOKENS).logits
        assert not ours.model.moe_layers() and (ours(TOKENS) - expected).abs().max().item() < 1e-4
    run = subprocess.run(tool + ["upcycle", "--input", str(tmp_path / "ours"), "--output", str(tmp_path / "moe"),
                                 "--num-experts", "8", "--top-k", "1"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    moe = load_model(str(tmp_path / "moe"))
    assert moe.cfg.moe.top_k == 1 and moe.cfg.moe.num_experts == 8 and moe.cfg.moe.norm_topk_prob
    with torch.no_grad():
        assert (moe(TOKENS) - expected).abs().max().item() < 1e-4
    theirs, config = _exported_logits(tmp_path / "moe", tmp_path / "hf_moe", "qwen3")
    assert config["norm_topk_prob"] is True and config["num_experts"] == 8 and config["tie_word_embeddings"]
    assert (theirs - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("family,field,value", [
    ("llama", "attention_bias", True), ("llama", "mlp_bias", True),
    ("llama", "rope_parameters", {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}),
    ("mistral", "sliding_window", 16), ("qwen3", "use_sliding_window", True)])  # windows below the 64 positions
def test_unsupported_dense_fields_are_refused_by_name(family, field, value):
    hf = dict(getattr(transformers, DENSE[family][0])(**SMALL, **DENSE[family][2]).to_dict(), **{field: value})
    if field == "use_sliding_window":
        hf["sliding_window"] = 16
    with pytest.raises(ValueError, match=field.replace("rope_parameters", "rope_scaling").replace("use_", "")):
        import_family_of(family).overrides(hf)


def test_upcycle_refusals(tmp_path):
    _dense_model("llama", tmp_path / "dense")
    with pytest.raises(ValueError, match="^not LlamaForCausalLM-shaped: moe.layer_freq=1"):
        offline.import_hf(str(tmp_path / "dense"), str(tmp_path / "x"), overrides=["moe.layer_freq=1"])
    with pytest.raises(ValueError, match="^not MixtralForCausalLM-shaped: moe.norm_topk_prob=false"):
        offline.import_hf(str(tmp_path / "dense"), str(tmp_path / "x"), overrides=["moe.norm_topk_prob=false"],
                          num_experts=4)
    with pytest.raises(ValueError, match="--num-experts 2 is smaller than moe.top_k=4"):
        offline.import_hf(str(tmp_path / "dense"), str(tmp_path / "x"), num_experts=2, top_k=4)
    with pytest.raises(ValueError, match="model_type='gpt2' is not supported; supported: .* llama, mistral, qwen3"):
        import_family_of("gpt2")


@pytest.mark.parametrize("override", ["moe.activation=swiglu_oss", "moe.expert_proj_bias=true"])
def test_upcycle_refuses_experts_that_compute_another_function(override):
    """Copies of a dense SwiGLU FFN without biases are not gpt-oss experts (clamped SwiGLU, biases)."""
    from megatron_moe.config import load_config

    target = load_config(None, ["model.activation=swiglu", "model.bias=false", "moe.num_experts=4", override])
    with pytest.raises(ValueError, match="^upcycling copies the dense FFN into the experts.*" + override.split("=")[0]):
        offline.upcycle_weights({}, target)
