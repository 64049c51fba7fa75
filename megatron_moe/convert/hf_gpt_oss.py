"""Hugging Face `GptOssForCausalLM` (gpt-oss-20b / gpt-oss-120b; transformers' models/gpt_oss).

The shape: RMSNorm, grouped-query attention with biases on q/k/v/o (`attention_bias` ->
`model.qkv_bias` + `model.attention_output_bias`) and a learned per-head sink logit in each softmax
denominator (`self_attn.sinks` -> `attention.sinks`, `model.attention_sinks`), sliding-window
attention on the layers `layer_types` names (`model.sliding_window`, `model.layer_types`), YaRN
rotary positions (`rope_parameters` / `rope_scaling` -> `model.rope_scaling.*`), every layer a
sparse MoE with a biased router (`mlp.router.weight` / `.bias` -> `ffn.router.weight` / `.bias`,
`moe.router_bias`), top-k over the router logits and a softmax over the k selected ones
(= our softmax over all E scores renormalized over the chosen k, `moe.norm_topk_prob: true`: both are
exp(l_i) / sum_{j in top-k} exp(l_j), the same k chosen), experts with biases (`moe.expert_proj_bias`)
and the clamped SwiGLU (`moe.activation: swiglu_oss`, limit `swiglu_limit`, alpha 1.702, `(up + 1)`),
no shared expert, untied output layer.

Experts are stored fused, gate and up interleaved on the last dimension:

    mlp.experts.gate_up_proj [E, h, 2f]  (gate = [..., ::2], up = [..., 1::2]) <-> ffn.experts.w1 [E, h, 2, f]
    mlp.experts.gate_up_proj_bias [E, 2f] (interleaved the same way)           <-> ffn.experts.b1 [E, 2, f]
    mlp.experts.down_proj [E, f, h], down_proj_bias [E, h]                     <-> ffn.experts.w2, b2

The published checkpoints store `gate_up_proj` and `down_proj` in MXFP4 (OCP Microscaling: FP4 E2M1
values, two a byte, low nibble first, one E8M0 scale 2^(s - 127) per block of 32) as
`<proj>_blocks` [E, rows, cols / 32, 16] and `<proj>_scales` [E, rows, cols / 32], rows / cols the
transposed weight's ([E, 2f, h] for gate_up_proj, [E, h, f] for down_proj). Import dequantizes them
to bf16 exactly as transformers' `integrations/mxfp4.py` does (`dequantize_mxfp4`) and says so; export
writes the unquantized tensors (fp32 or bf16, `--precision`), which transformers loads as they are.
"""
from __future__ import annotations

import sys
from typing import Iterator, List, Tuple

import torch

from megatron_moe.config.schema import Config
from megatron_moe.convert.hf_common import (Family, MissingTensor, Tensors, base_hf_config, base_overrides,
                                            norm_topk, num_experts)
from megatron_moe.convert.hf_rope import rope_parameters, rope_scaling_hf

# FP4 E2M1 by 4-bit code (sign bit 3): transformers' FP4_VALUES
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SWIGLU_ALPHA = 1.702  # the sigmoid gain transformers' GptOssExperts and the MXFP4 kernels use
SLIDING, FULL = "sliding_attention", "full_attention"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """MXFP4 `blocks` [E, R, G, 16] (uint8) and `scales` [E, R, G] (uint8) -> [E, 32 G, R] in `dtype`:
    value 2k of a block is the low nibble of byte k, 2k + 1 the high one, each times 2^(scale - 127)
    (transformers' `convert_moe_packed_tensors`, the same ops in the same dtype), one expert at a
    time (the int32 codes of a whole gpt-oss-120b layer would take 4 GB)."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    e, r, g, _ = blocks.shape
    out = torch.empty(e, 32 * g, r, dtype=dtype)
    for j in range(e):
        codes = blocks[j].to(torch.int32)  # [R, G, 16]
        values = torch.stack([lut[codes & 0x0F], lut[codes >> 4]], dim=-1).flatten(-2)  # [R, G, 32]
        values = torch.ldexp(values, (scales[j].to(torch.int32) - 127).unsqueeze(-1)).to(dtype)
        out[j] = values.flatten(-2).t()  # [R, 32 G] -> [32 G, R]
    return out


def layer_types(cfg: Config) -> List[str]:
    """HF `layer_types` of our model: `model.layer_types`, or every layer sliding when only
    `model.sliding_window` is set, or every layer full."""
    m = cfg.model
    return list(m.layer_types) if m.layer_types else [SLIDING if m.sliding_window else FULL] * m.num_layers


# -- config.json <-> ours ---------------------------------------------------------------------------
def _check(cfg: Config):
    m, moe, rope = cfg.model, cfg.moe, cfg.model.rope_scaling
    return [
        (m.qk_norm == "none", f"model.qk_norm={m.qk_norm} (gpt-oss has no QK-norm)"),
        (m.attention_sinks, "model.attention_sinks=false (every gpt-oss attention layer has sinks)"),
        (bool(m.qkv_bias) == bool(m.attention_output_bias),
         "model.qkv_bias != model.attention_output_bias (gpt-oss's attention_bias covers q/k/v and o together)"),
        # any mscale / mscale_all_dim: transformers' gpt-oss reads them as ours does (cos / sin only, model/rotary.py)
        (rope.type in ("none", "yarn"), f"model.rope_scaling.type={rope.type} (gpt-oss: yarn or none)"),
        (moe.router_bias, "moe.router_bias=false (the gpt-oss router has a bias)"),
        (bool(moe.expert_proj_bias), "moe.expert_proj_bias=false (gpt-oss experts have biases)"),
        (moe.activation == "swiglu_oss", f"moe.activation={moe.activation} (gpt-oss experts use swiglu_oss)"),
        (moe.layer_freq == 1, f"moe.layer_freq={moe.layer_freq} (every gpt-oss layer is MoE)"),
        (norm_topk(cfg), "moe.norm_topk_prob=false (gpt-oss's softmax over the k selected logits sums to one)"),
        (moe.shared_expert_ffn_hidden_size is None, "moe.shared_expert_ffn_hidden_size (gpt-oss has no shared expert)"),
    ]


def _hf_config(cfg: Config) -> dict:
    m, moe = cfg.model, cfg.moe
    out = base_hf_config(GPT_OSS, cfg)
    out.update({"intermediate_size": moe.expert_ffn_hidden_size or m.ffn_hidden_size,
                "num_local_experts": moe.num_experts, "attention_bias": bool(m.qkv_bias),
                "swiglu_limit": moe.swiglu_limit, "swiglu_alpha": SWIGLU_ALPHA, "rope_parameters": rope_scaling_hf(cfg),
                # HF builds the sliding-window mask whatever the layers: a window the full layers never use
                "sliding_window": m.sliding_window or m.seq_length, "layer_types": layer_types(cfg)})
    return out


def _overrides(hf: dict) -> List[str]:
    quant = hf.get("quantization_config") or {}
    if quant and quant.get("quant_method") != "mxfp4":
        raise ValueError(f"quantization_config.quant_method={quant.get('quant_method')!r} is not supported "
                         "(mxfp4 experts are dequantized on import)")
    if float(hf.get("swiglu_alpha", SWIGLU_ALPHA)) != SWIGLU_ALPHA:
        raise ValueError(f"swiglu_alpha={hf['swiglu_alpha']} is not supported ({SWIGLU_ALPHA}, as gpt-oss)")
    rope = rope_parameters(hf)
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor={rope['partial_rotary_factor']} is not supported (gpt-oss: 1)")
    out = []
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(n)]  # GptOssConfig's default
    if len(types) != n or set(types) - {SLIDING, FULL}:
        raise ValueError(f"layer_types={types} is not supported ({n} of {SLIDING} | {FULL})")
    if SLIDING in types:
        if not hf.get("sliding_window"):
            raise ValueError(f"sliding_window={hf.get('sliding_window')} with {SLIDING} layers in layer_types")
        out += [f"model.sliding_window={hf['sliding_window']}", f"model.layer_types=[{','.join(types)}]"]
    else:
        out += ["model.sliding_window=null", "model.layer_types=null"]
    bias = str(bool(hf.get("attention_bias", True))).lower()
    # sliding windows mapped here, not by base_overrides (which refuses them); YaRN there (yarn=True)
    rest = {k: v for k, v in hf.items() if k not in ("sliding_window", "layer_types")}
    rest["rope_theta"] = hf.get("rope_theta", 150000.0)  # GptOssConfig.default_theta
    return base_overrides(rest, yarn=True) + out + [
        f"model.ffn_hidden_size={hf['intermediate_size']}", f"moe.num_experts={num_experts(hf, 'num_local_experts')}",
        f"moe.expert_ffn_hidden_size={hf['intermediate_size']}", "moe.layer_freq=1", "moe.norm_topk_prob=true",
        "moe.score_function=softmax", "moe.activation=swiglu_oss", f"moe.swiglu_limit={float(hf.get('swiglu_limit', 7.0))}",
        "moe.router_bias=true", "moe.expert_proj_bias=true", "model.attention_sinks=true", "model.qk_norm=none",
        f"model.qkv_bias={bias}", f"model.attention_output_bias={bias}"]


# -- tensors: the router and the fused experts of one layer -----------------------------------------
def _moe_to_hf(cfg: Config, ours: Tensors, src: str, dst: str) -> Iterator[Tuple[str, torch.Tensor]]:
    """Our layer (`src` = "layers.i.") -> HF `dst` = "model.layers.i.mlp." tensors."""
    yield dst + "router.weight", ours[src + "ffn.router.weight"]
    yield dst + "router.bias", ours[src + "ffn.router.bias"]
    w1, b1 = ours[src + "ffn.experts.w1"], ours[src + "ffn.experts.b1"]  # [E, h, 2, f], [E, 2, f]
    yield dst + "experts.gate_up_proj", w1.transpose(-1, -2).flatten(-2)  # [E, h, f, 2] -> [E, h, 2f] interleaved
    yield dst + "experts.gate_up_proj_bias", b1.transpose(-1, -2).flatten(-2)
    yield dst + "experts.down_proj", ours[src + "ffn.experts.w2"]
    yield dst + "experts.down_proj_bias", ours[src + "ffn.experts.b2"]


def _fused(hf, name: str, announce: bool) -> torch.Tensor:
    """HF expert tensor `name`, or its MXFP4 `_blocks` / `_scales` dequantized to bf16."""
    try:
        return hf(name)
    except MissingTensor as missing:
        try:
            blocks, scales = hf(name + "_blocks"), hf(name + "_scales")
        except MissingTensor:
            raise MissingTensor(f"{missing} (nor its MXFP4 {name}_blocks + {name}_scales)") from None
    if announce:
        print("gpt_oss: experts stored in MXFP4 (gate_up_proj / down_proj _blocks + _scales): dequantized to bf16 "
              "as transformers does", file=sys.stderr)
    return dequantize_mxfp4(blocks, scales)


def _moe_from_hf(cfg: Config, hf, src: str, dst: str) -> Tensors:
    """HF `src` = "model.layers.i.mlp." tensors -> our layer `dst` = "layers.i." (announces MXFP4 at layer 0)."""
    f = cfg.moe.expert_ffn_hidden_size or cfg.model.ffn_hidden_size
    first = src.startswith("model.layers.0.")
    gate_up = _fused(hf, src + "experts.gate_up_proj", first)  # [E, h, 2f]
    return {dst + "ffn.router.weight": hf(src + "router.weight"), dst + "ffn.router.bias": hf(src + "router.bias"),
            dst + "ffn.experts.w1": gate_up.unflatten(-1, (f, 2)).transpose(-1, -2),  # [E, h, 2, f]
            dst + "ffn.experts.b1": hf(src + "experts.gate_up_proj_bias").unflatten(-1, (f, 2)).transpose(-1, -2),
            dst + "ffn.experts.w2": _fused(hf, src + "experts.down_proj", False),  # [E, f, h]
            dst + "ffn.experts.b2": hf(src + "experts.down_proj_bias")}


GPT_OSS = Family("gpt_oss", "GptOssForCausalLM", "mlp", ("gate_up_proj", "gate_up_proj", "down_proj"),
                 _check, _hf_config, _overrides,
                 allows=("model.attention_sinks", "model.sliding_window", "model.rope_scaling", "model.attention_output_bias",
                         "moe.router_bias", "moe.expert_proj_bias", "moe.activation"),
                 moe_to_hf=_moe_to_hf, moe_from_hf=_moe_from_hf)
