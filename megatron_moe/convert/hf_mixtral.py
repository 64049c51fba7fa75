"""Our Mixtral-shaped GPT-MoE <-> Hugging Face `MixtralForCausalLM` (config.json + safetensors).

Mixtral (Jiang et al. 2024, §2) = RMSNorm, rotary positions, no biases, untied output layer, every
layer a sparse MoE of SwiGLU experts with softmax -> top-k -> renormalize routing, dropless.
Tensors are mapped on full (global) weights, in the original Mixtral naming
(`block_sparse_moe.experts.<j>.w1|w2|w3`), which transformers loads directly:

    embedding.word.weight [V, h]                -> model.embed_tokens.weight
    layers.i.attention_norm.weight              -> model.layers.i.input_layernorm.weight
    layers.i.attention.qkv.weight [3h, h]       -> q_proj / k_proj / v_proj [h, h]: our rows are
                                                   ordered [head, (q|k|v), head_dim] (attention.py)
    layers.i.attention.proj.weight              -> o_proj.weight
    layers.i.ffn_norm.weight                    -> post_attention_layernorm.weight
    layers.i.ffn.router.weight [E, h]           -> block_sparse_moe.gate.weight
    layers.i.ffn.experts.w1 [E, h, 2, f]        -> experts.j.w1 (gate) = w1[j][:, 0]^T,
                                                   experts.j.w3 (up)   = w1[j][:, 1]^T  (mlp.py's halves)
    layers.i.ffn.experts.w2 [E, f, h]           -> experts.j.w2.weight = w2[j]^T
    final_norm.weight, output.weight            -> model.norm.weight, lm_head.weight

Both sides use the rotate-half RoPE convention (rotary.py, HF `rotate_half`) over the same head
dims, so q/k rows need no permutation.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Dict

import torch

from megatron_moe.config.schema import Config

Tensors = Dict[str, torch.Tensor]


def check_mixtral_shaped(cfg: Config) -> None:
    """Raise ValueError naming the first option that has no Mixtral equivalent."""
    m, moe = cfg.model, cfg.moe
    rules = [
        (m.normalization == "rmsnorm", f"model.normalization={m.normalization} (Mixtral uses rmsnorm)"),
        (m.activation == "swiglu", f"model.activation={m.activation} (Mixtral experts use swiglu)"),
        (m.position_embedding == "rope", f"model.position_embedding={m.position_embedding} (Mixtral uses rope)"),
        (not m.bias, "model.bias=true (Mixtral has no biases)"),
        (not m.tie_embeddings, "model.tie_embeddings=true (Mixtral's lm_head is untied)"),
        (moe.layer_freq == 1, f"moe.layer_freq={moe.layer_freq} (every Mixtral layer is MoE)"),
        (moe.top_k >= 2, "moe.top_k=1 (Switch weighting uses the raw top-1 probability; Mixtral renormalizes to 1)"),
        (moe.capacity_factor is None, f"moe.capacity_factor={moe.capacity_factor} (Mixtral is dropless)"),
    ]
    for ok, what in rules:
        if not ok:
            raise ValueError(f"not Mixtral-shaped: {what}")


def hf_config(cfg: Config, dtype: torch.dtype = torch.float32) -> dict:
    """config.json of the HF Mixtral equal to `cfg`'s model, its weights stored in `dtype`."""
    m, moe = cfg.model, cfg.moe
    return {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "torch_dtype": str(dtype).split(".")[-1],
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size,
        "intermediate_size": moe.expert_ffn_hidden_size or m.ffn_hidden_size,
        "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_attention_heads, "head_dim": m.hidden_size // m.num_attention_heads,
        "hidden_act": "silu", "max_position_embeddings": m.seq_length, "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "tie_word_embeddings": False, "sliding_window": None, "attention_dropout": 0.0,
        "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": moe.aux_loss_coeff, "router_jitter_noise": 0.0, "output_router_logits": False,
        "initializer_range": m.init_std, "use_cache": True,
    }


def config_overrides_from_hf(hf: dict) -> list:
    """Dotted overrides that make our config Mixtral-shaped like `hf` (config.json)."""
    heads = hf["num_attention_heads"]
    if hf.get("num_key_value_heads", heads) != heads:
        raise ValueError(f"num_key_value_heads={hf['num_key_value_heads']} != num_attention_heads={heads}: "
                         "grouped-query attention is not supported")
    if hf.get("head_dim") not in (None, hf["hidden_size"] // heads):
        raise ValueError(f"head_dim={hf['head_dim']} != hidden_size / num_attention_heads")
    if hf.get("hidden_act", "silu") != "silu" or hf.get("tie_word_embeddings", False):
        raise ValueError("only hidden_act=silu with tie_word_embeddings=false is supported")
    if hf.get("sliding_window") not in (None, 0) and hf["sliding_window"] < hf["max_position_embeddings"]:
        raise ValueError(f"sliding_window={hf['sliding_window']} attention is not supported")
    rope = (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 1e6))
    return [f"model.num_layers={hf['num_hidden_layers']}", f"model.hidden_size={hf['hidden_size']}",
            f"model.ffn_hidden_size={hf['intermediate_size']}", f"model.num_attention_heads={heads}",
            f"model.seq_length={hf['max_position_embeddings']}", f"model.vocab_size={hf['vocab_size']}",
            "model.normalization=rmsnorm", "model.activation=swiglu", "model.position_embedding=rope",
            f"model.rope_theta={float(rope)}", "model.bias=false", "model.tie_embeddings=false",
            f"model.norm_eps={float(hf.get('rms_norm_eps', 1e-5))}",
            f"model.init_std={float(hf.get('initializer_range', 0.02))}", "model.dropout=0.0",
            f"moe.num_experts={hf['num_local_experts']}", f"moe.top_k={hf['num_experts_per_tok']}",
            f"moe.expert_ffn_hidden_size={hf['intermediate_size']}", "moe.layer_freq=1", "moe.capacity_factor=null",
            f"moe.aux_loss_coeff={float(hf.get('router_aux_loss_coef', 0.02))}"]


def to_hf(cfg: Config, ours: Tensors) -> Tensors:
    """Our full weights (`<param name>` keys) -> HF Mixtral tensors."""
    check_mixtral_shaped(cfg)
    m = cfg.model
    heads, d = m.num_attention_heads, m.hidden_size // m.num_attention_heads
    out = {"model.embed_tokens.weight": ours["embedding.word.weight"], "model.norm.weight": ours["final_norm.weight"],
           "lm_head.weight": ours["output.weight"]}
    for i in range(m.num_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        q, k, v = ours[src + "attention.qkv.weight"].view(heads, 3, d, m.hidden_size).unbind(1)  # each [heads, d, h]
        out.update({
            dst + "input_layernorm.weight": ours[src + "attention_norm.weight"],
            dst + "self_attn.q_proj.weight": q.reshape(heads * d, -1),
            dst + "self_attn.k_proj.weight": k.reshape(heads * d, -1),
            dst + "self_attn.v_proj.weight": v.reshape(heads * d, -1),
            dst + "self_attn.o_proj.weight": ours[src + "attention.proj.weight"],
            dst + "post_attention_layernorm.weight": ours[src + "ffn_norm.weight"],
            dst + "block_sparse_moe.gate.weight": ours[src + "ffn.router.weight"],
        })
        w1, w2 = ours[src + "ffn.experts.w1"], ours[src + "ffn.experts.w2"]  # [E, h, 2, f], [E, f, h]
        for j in range(w1.shape[0]):
            e = dst + f"block_sparse_moe.experts.{j}."
            out[e + "w1.weight"] = w1[j][:, 0].t()
            out[e + "w3.weight"] = w1[j][:, 1].t()
            out[e + "w2.weight"] = w2[j].t()
    return {k: v.contiguous() for k, v in out.items()}


def from_hf(cfg: Config, hf: Tensors) -> Tensors:
    """HF Mixtral tensors -> our full weights (`<param name>` keys); the inverse of `to_hf`."""
    m, num_experts = cfg.model, cfg.moe.num_experts
    out = {"embedding.word.weight": hf["model.embed_tokens.weight"], "final_norm.weight": hf["model.norm.weight"],
           "output.weight": hf["lm_head.weight"]}
    for i in range(m.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        qkv = torch.stack([hf[src + f"self_attn.{p}_proj.weight"].view(m.num_attention_heads, -1, m.hidden_size)
                           for p in "qkv"], dim=1)  # [heads, 3, d, h]
        out.update({
            dst + "attention_norm.weight": hf[src + "input_layernorm.weight"],
            dst + "attention.qkv.weight": qkv.reshape(3 * m.hidden_size, m.hidden_size),
            dst + "attention.proj.weight": hf[src + "self_attn.o_proj.weight"],
            dst + "ffn_norm.weight": hf[src + "post_attention_layernorm.weight"],
            dst + "ffn.router.weight": hf[src + "block_sparse_moe.gate.weight"],
        })
        e = src + "block_sparse_moe.experts.{}."
        gate = torch.stack([hf[e.format(j) + "w1.weight"].t() for j in range(num_experts)])  # [E, h, f]
        up = torch.stack([hf[e.format(j) + "w3.weight"].t() for j in range(num_experts)])  # [E, h, f]
        out[dst + "ffn.experts.w1"] = torch.stack([gate, up], dim=2)  # [E, h, 2, f]
        out[dst + "ffn.experts.w2"] = torch.stack([hf[e.format(j) + "w2.weight"].t() for j in range(num_experts)])
    return {k: v.contiguous() for k, v in out.items()}


def write_hf_dir(path: str, config: dict, tensors: Tensors) -> None:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def read_hf_dir(path: str):
    """(config.json dict, tensors of every *.safetensors file) of a Hugging Face model directory."""
    from safetensors.torch import load_file

    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{path} has no config.json")
    with open(config_path) as f:
        config = json.load(f)
    if config.get("model_type") != "mixtral":
        raise ValueError(f"{config_path}: model_type={config.get('model_type')!r}, expected 'mixtral'")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"{path} has no *.safetensors files (pickled .bin weights are not read)")
    tensors: Tensors = {}
    for file in files:
        tensors.update(load_file(file))
    return config, tensors
