"""Hugging Face checkpoints of the four MoE families (convert/hf_common.py), both ways.

For each family a tiny random model built locally by `transformers` from a config shaped like the
released one (heads / kv heads, QK-norm, shared expert, router settings), every weight perturbed so
that norms and biases are not at their init: import -> our logits equal transformers' (fp32, 1e-4);
export (streamed into several shards + index) -> the same tensors bit for bit, and
`from_pretrained` loads it with the same logits; the checkpoint resharded to tensor 2 x expert 2
exports the same tensors. The published Mixtral-8x7B and Qwen3-30B-A3B `config.json` values import
into a model of transformers' parameter count (both built on the meta device)."""
import json

import pytest
import torch

from megatron_moe import load_model
from megatron_moe.config import load_config
from megatron_moe.convert import offline
from megatron_moe.convert.hf_common import INDEX
from megatron_moe.convert.hf_families import family_of
from megatron_moe.model.gpt import GPTMoEModel
from megatron_moe.distributed.parallel_state import ParallelState
from tests.checkpoint_helpers import hf_tensors, random_hf_model

transformers = pytest.importorskip("transformers")
TOKENS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
SMALL = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
             rms_norm_eps=1e-6)
FAMILIES = {  # released shapes, scaled down
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",  # Mixtral-8x7B: 32 heads, 8 kv heads, top-2 of 8
                dict(num_key_value_heads=2, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",  # Qwen3-30B-A3B: 32 heads, 4 kv, head_dim 128, top-8 of 128
                  dict(num_key_value_heads=2, head_dim=16, intermediate_size=48, moe_intermediate_size=16,
                       num_experts=8, num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",  # Qwen1.5-MoE-A2.7B: 4 shared-size expert, top-4 of 60
                  dict(num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16,
                       shared_expert_intermediate_size=24, num_experts=8, num_experts_per_tok=4, norm_topk_prob=False,
                       decoder_sparse_step=2)),  # every other layer dense: the dense MLP mapping too
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",  # OLMoE-1B-7B: 16 heads (MHA), qk-norm, top-8 of 64
              dict(num_key_value_heads=4, intermediate_size=16, num_experts=8, num_experts_per_tok=4,
                   norm_topk_prob=False)),
}


def _hf_model(family, path):
    config_cls, model_cls, extra = FAMILIES[family]
    return random_hf_model(config_cls, model_cls, dict(SMALL, **extra), path)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_round_trip_and_logits(family, tmp_path):
    hf = _hf_model(family, tmp_path / "hf")
    offline.import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    ours = load_model(str(tmp_path / "ours"))
    with torch.no_grad():
        expected = hf(TOKENS).logits
        assert (ours(TOKENS) - expected).abs().max().item() < 1e-4
    offline.export_hf(str(tmp_path / "ours"), str(tmp_path / "out"), max_shard_bytes=64 << 10)
    index = json.loads((tmp_path / "out" / INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 1  # streamed into several shards
    original, exported = hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "out")
    assert original.keys() == exported.keys()
    assert all(torch.equal(original[k], exported[k]) for k in original), family
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == family
    reloaded = getattr(transformers, FAMILIES[family][1]).from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    with torch.no_grad():
        assert (reloaded.eval()(TOKENS).logits - expected).abs().max().item() < 1e-4
    # a checkpoint in another layout (chunks of tensor 2 x expert 2) exports the same tensors
    resharded = offline.reshard(str(tmp_path / "ours"), str(tmp_path / "tp2ep2"), 2, 2, 1)
    offline.export_hf(resharded, str(tmp_path / "out2"))
    again = hf_tensors(tmp_path / "out2")
    assert again.keys() == original.keys() and all(torch.equal(original[k], again[k]) for k in original)


MIXTRAL_8X7B = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000,
                "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "hidden_act": "silu", "max_position_embeddings": 32768,
                "rms_norm_eps": 1e-5, "rope_theta": 1e6, "sliding_window": None, "tie_word_embeddings": False,
                "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02}
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
                 "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "hidden_act": "silu",
                 "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "rope_scaling": None,
                 "sliding_window": None, "use_sliding_window": False, "tie_word_embeddings": False,
                 "attention_bias": False, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
                 "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.001}


@pytest.mark.parametrize("hf,published", [(MIXTRAL_8X7B, 46.7e9), (QWEN3_30B_A3B, 30.5e9)], ids=["mixtral", "qwen3"])
def test_real_configs_import_with_the_published_parameter_count(hf, published):
    cfg = load_config(None, family_of(hf["model_type"]).overrides(hf) + offline.SINGLE)
    with torch.device("meta"):
        ours = sum(p.numel() for p in GPTMoEModel(cfg, ParallelState.single_process()).parameters())
        config = getattr(transformers, {"mixtral": "MixtralConfig", "qwen3_moe": "Qwen3MoeConfig"}[hf["model_type"]])(**hf)
        theirs = sum(p.numel() for p in getattr(transformers, hf["architectures"][0])(config).parameters())
    assert ours == theirs and abs(ours - published) < 0.05e9, (ours, theirs)


@pytest.mark.parametrize("field,value", [("sliding_window", 4096), ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}),
                                         ("kv_lora_rank", 512), ("mlp_only_layers", [0])])
def test_unsupported_fields_are_refused_by_name(field, value):
    hf = dict(QWEN3_30B_A3B, **{field: value})
    if field == "sliding_window":
        hf["use_sliding_window"] = True
    with pytest.raises(ValueError, match=field):
        family_of("qwen3_moe").overrides(hf)


def test_convert_checkpoint_help_lists_every_family(capsys):
    """`tools/convert_checkpoint.py --help` (the module docstring) and `export-hf --help` name every
    family export-hf writes."""
    from megatron_moe.convert.hf_families import FAMILIES
    from tools.convert_checkpoint import main

    for argv in (["--help"], ["export-hf", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        out = capsys.readouterr().out
        assert [f for f in FAMILIES if f not in out] == [], argv


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_partial_rotary_factor_is_refused_where_it_is_not_mapped(family):
    """transformers moves a top-level `partial_rotary_factor` into the rope parameters and rotates only
    that fraction of each head: a family without `model.rotary_percent` refuses it by name (GLM-4.5
    maps it: tests/unit/test_hf_deepseek.py)."""
    from tests.unit.test_hf_deepseek import DEEPSEEK_V3
    from tests.unit.test_hf_gpt_oss import GPT_OSS_20B

    hf = {"qwen3_moe": QWEN3_30B_A3B, "deepseek_v3": DEEPSEEK_V3, "gpt_oss": GPT_OSS_20B}[family]
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5"):
        family_of(family).overrides(dict(hf, partial_rotary_factor=0.5))
