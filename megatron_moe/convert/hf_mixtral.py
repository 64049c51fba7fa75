"""Hugging Face `MixtralForCausalLM` (Jiang et al. 2024, §2): RMSNorm, rotary positions, no
biases, grouped-query attention (Mixtral-8x7B: 8 key/value heads for 32), every layer a sparse MoE
of SwiGLU experts (`block_sparse_moe.experts.<j>.w1|w3|w2` = gate | up | down) with softmax ->
top-k -> renormalize routing, dropless. The tensor mapping is `hf_common.py`'s.
"""
from __future__ import annotations

from megatron_moe.config.schema import Config
from megatron_moe.convert.hf_common import Family, base_hf_config, base_overrides, norm_topk, num_experts


def _check(cfg: Config):
    m, moe = cfg.model, cfg.moe
    return [
        (m.qk_norm == "none", f"model.qk_norm={m.qk_norm} (Mixtral has no QK-norm)"),
        (not m.qkv_bias, "model.qkv_bias=true (Mixtral has no biases)"),
        (moe.layer_freq == 1, f"moe.layer_freq={moe.layer_freq} (every Mixtral layer is MoE)"),
        (norm_topk(cfg), "moe.norm_topk_prob=false (Mixtral renormalizes the top-k weights to 1)"),
        (moe.shared_expert_ffn_hidden_size is None, "moe.shared_expert_ffn_hidden_size (Mixtral has no shared expert)"),
    ]


def _hf_config(cfg: Config) -> dict:
    moe = cfg.moe
    out = base_hf_config(MIXTRAL, cfg)
    out.update({"intermediate_size": moe.expert_ffn_hidden_size or cfg.model.ffn_hidden_size,
                "num_local_experts": moe.num_experts, "sliding_window": None, "router_jitter_noise": 0.0})
    return out


def _overrides(hf: dict) -> list:
    return base_overrides(hf) + [
        f"model.ffn_hidden_size={hf['intermediate_size']}", f"moe.num_experts={num_experts(hf, 'num_local_experts')}",
        f"moe.expert_ffn_hidden_size={hf['intermediate_size']}", "moe.layer_freq=1", "moe.norm_topk_prob=true"]


MIXTRAL = Family("mixtral", "MixtralForCausalLM", "block_sparse_moe", ("w1", "w3", "w2"),
                 _check, _hf_config, _overrides)
