"""Hugging Face `OlmoeForCausalLM` (OLMoE-1B-7B, Muennighoff et al. 2024): RMSNorm, rotary
positions, RMSNorm of the whole q and k projections (`model.qk_norm: full`), every layer a sparse
MoE of SwiGLU experts `mlp.experts.<j>.gate_proj|up_proj|down_proj` of `intermediate_size`,
softmax top-k routing without renormalization (`norm_topk_prob: false`), dropless. `clip_qkv` is
refused unless null.
"""
from __future__ import annotations

from megatron_moe.config.schema import Config
from megatron_moe.convert.hf_common import Family, base_hf_config, base_overrides, norm_topk, num_experts


def _check(cfg: Config):
    m, moe = cfg.model, cfg.moe
    return [(m.qk_norm == "full", f"model.qk_norm={m.qk_norm} (OLMoE normalizes the whole q / k projection: full)"),
            (not m.qkv_bias, "model.qkv_bias=true (OLMoE has attention_bias=false)"),
            (moe.layer_freq == 1, f"moe.layer_freq={moe.layer_freq} (every OLMoE layer is MoE)"),
            (moe.shared_expert_ffn_hidden_size is None, "moe.shared_expert_ffn_hidden_size (OLMoE has no shared expert)")]


def _hf_config(cfg: Config) -> dict:
    out = base_hf_config(OLMOE, cfg)
    out.update({"intermediate_size": cfg.moe.expert_ffn_hidden_size or cfg.model.ffn_hidden_size,
                "num_experts": cfg.moe.num_experts, "norm_topk_prob": norm_topk(cfg), "clip_qkv": None,
                "attention_bias": False})
    return out


def _overrides(hf: dict) -> list:
    if hf.get("clip_qkv") is not None:
        raise ValueError(f"clip_qkv={hf['clip_qkv']} is not supported")
    if hf.get("attention_bias"):
        raise ValueError("attention_bias=true is not supported (biases on q/k/v and o_proj)")
    return base_overrides(hf) + [
        f"model.ffn_hidden_size={hf['intermediate_size']}", f"moe.num_experts={num_experts(hf)}",
        f"moe.expert_ffn_hidden_size={hf['intermediate_size']}", "moe.layer_freq=1", "model.qk_norm=full",
        f"moe.norm_topk_prob={str(bool(hf.get('norm_topk_prob', False))).lower()}"]


OLMOE = Family("olmoe", "OlmoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"),
               _check, _hf_config, _overrides)
