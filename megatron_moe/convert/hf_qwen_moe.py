"""Hugging Face `Qwen2MoeForCausalLM` (Qwen1.5-MoE / Qwen2-57B-A14B) and `Qwen3MoeForCausalLM`
(Qwen3-30B-A3B, Qwen3-235B-A22B). Both: RMSNorm, rotary positions, grouped-query attention, SwiGLU
experts `mlp.experts.<j>.gate_proj|up_proj|down_proj`, softmax top-k routing with
`norm_topk_prob`, every `decoder_sparse_step`-th layer MoE (= `moe.layer_freq`; the others a dense
SwiGLU MLP of `intermediate_size`), experts of `moe_intermediate_size`.

* Qwen2-MoE: q/k/v biases (`model.qkv_bias`), one shared expert of
  `shared_expert_intermediate_size` gated by sigmoid(`shared_expert_gate`) (`moe.shared_expert_*`).
* Qwen3-MoE: per-head RMSNorm of q and k before rotary positions (`model.qk_norm: head`),
  `head_dim` independent of hidden / heads, no shared expert.
`mlp_only_layers` (dense layers by index) is refused unless empty.
"""
from __future__ import annotations

from megatron_moe.config.schema import Config
from megatron_moe.convert.hf_common import Family, base_hf_config, base_overrides, norm_topk, num_experts


def _common_hf(family: Family, cfg: Config) -> dict:
    m, moe = cfg.model, cfg.moe
    out = base_hf_config(family, cfg)
    out.update({"intermediate_size": m.ffn_hidden_size, "moe_intermediate_size": moe.expert_ffn_hidden_size or m.ffn_hidden_size,
                "num_experts": moe.num_experts, "norm_topk_prob": norm_topk(cfg), "decoder_sparse_step": moe.layer_freq,
                "mlp_only_layers": [], "use_sliding_window": False, "sliding_window": None})
    return out


def _common_overrides(hf: dict) -> list:
    if hf.get("mlp_only_layers"):
        raise ValueError(f"mlp_only_layers={hf['mlp_only_layers']} is not supported (use decoder_sparse_step)")
    return base_overrides(hf) + [
        f"model.ffn_hidden_size={hf['intermediate_size']}", f"moe.num_experts={num_experts(hf)}",
        f"moe.expert_ffn_hidden_size={hf['moe_intermediate_size']}", f"moe.layer_freq={hf.get('decoder_sparse_step', 1)}",
        f"moe.norm_topk_prob={str(bool(hf.get('norm_topk_prob', False))).lower()}"]


def _qwen2_check(cfg: Config):
    moe = cfg.moe
    return [(cfg.model.qk_norm == "none", f"model.qk_norm={cfg.model.qk_norm} (Qwen2-MoE has no QK-norm)"),
            (moe.shared_expert_ffn_hidden_size is not None and moe.shared_expert_gate,
             "Qwen2-MoE has a gated shared expert: set moe.shared_expert_ffn_hidden_size and moe.shared_expert_gate=true")]


def _qwen2_hf(cfg: Config) -> dict:
    out = _common_hf(QWEN2_MOE, cfg)
    out.update({"qkv_bias": bool(cfg.model.qkv_bias), "shared_expert_intermediate_size": cfg.moe.shared_expert_ffn_hidden_size})
    return out


def _qwen2_overrides(hf: dict) -> list:
    return _common_overrides(hf) + [
        f"model.qkv_bias={str(bool(hf.get('qkv_bias', True))).lower()}",
        f"moe.shared_expert_ffn_hidden_size={hf['shared_expert_intermediate_size']}", "moe.shared_expert_gate=true"]


def _qwen3_check(cfg: Config):
    return [(cfg.model.qk_norm == "head", f"model.qk_norm={cfg.model.qk_norm} (Qwen3-MoE normalizes each q / k head: head)"),
            (not cfg.model.qkv_bias, "model.qkv_bias=true (Qwen3-MoE has attention_bias=false)"),
            (cfg.moe.shared_expert_ffn_hidden_size is None, "moe.shared_expert_ffn_hidden_size (Qwen3-MoE has no shared expert)")]


def _qwen3_hf(cfg: Config) -> dict:
    out = _common_hf(QWEN3_MOE, cfg)
    out["attention_bias"] = False
    return out


def _qwen3_overrides(hf: dict) -> list:
    if hf.get("attention_bias"):
        raise ValueError("attention_bias=true is not supported (biases on q/k/v and o_proj)")
    return _common_overrides(hf) + ["model.qk_norm=head"]


QWEN2_MOE = Family("qwen2_moe", "Qwen2MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"),
                   _qwen2_check, _qwen2_hf, _qwen2_overrides)
QWEN3_MOE = Family("qwen3_moe", "Qwen3MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"),
                   _qwen3_check, _qwen3_hf, _qwen3_overrides)
