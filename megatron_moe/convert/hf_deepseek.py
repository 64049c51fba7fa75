"""Hugging Face `DeepseekV3ForCausalLM` (`deepseek_v3`: DeepSeek-V3 / R1, Moonlight; Kimi K2, whose
config.json says `kimi_k2`: hf_families.IMPORT_ALIASES) and
`Glm4MoeForCausalLM` (`glm4_moe`: GLM-4.5, GLM-4.5-Air), checked against transformers' modeling
code. Both: RMSNorm, rotary positions, the first `first_k_dense_replace` layers dense (a SwiGLU MLP
of `intermediate_size`, `moe.first_k_dense`), the others MoE: `n_routed_experts` SwiGLU experts of
`moe_intermediate_size` routed by sigmoid scores (`moe.score_function: sigmoid`) chosen with the
per-expert bias `mlp.gate.e_score_correction_bias` (a buffer there, our frozen
`ffn.router.expert_bias`: `moe.expert_bias`) among the best `topk_group` of `n_group` groups
(`moe.router_groups` / `router_group_topk`; both rank a group by its two best biased scores, and
mask the rest to -inf), weights the unbiased scores renormalized (`norm_topk_prob`) and scaled by
`routed_scaling_factor` (`moe.topk_scaling_factor`), plus `n_shared_experts` ungated shared experts
`mlp.shared_experts.*` of n_shared x `moe_intermediate_size` (`moe.shared_expert_ffn_hidden_size`).

* DeepSeek-V3: multi-head latent attention (model/mla.py, `model.attention: mla`):

      layers.i.attention.q_down / q_down_norm / q_up  <-> self_attn.q_a_proj / q_a_layernorm / q_b_proj
      layers.i.attention.q (q_lora_rank null)        <-> self_attn.q_proj
      layers.i.attention.kv_down / kv_down_norm / kv_up <-> self_attn.kv_a_proj_with_mqa / kv_a_layernorm / kv_b_proj
      layers.i.attention.proj                         <-> self_attn.o_proj

  Rows are HF's (per head [nope | rope] in q_b_proj / q_proj, [latent | rope] in kv_a_proj_with_mqa,
  per head [k_nope | v] in kv_b_proj) except the rope rows under `rope_interleave: true` (every
  published checkpoint): transformers' `apply_rotary_pos_emb_interleave` rotates pairs (2i, 2i+1) and
  returns [evens | odds] rotated, which is our rotate-half of the rows permuted to (0, 2, 4, .., 1, 3,
  5, ..) (q and k permuted alike: the same scores). Import permutes them; export writes
  `rope_interleave: true` and permutes back, so an interleaved checkpoint round-trips bit for bit (a
  `rope_interleave: false` one comes back interleaved, the same model). YaRN `rope_scaling` ->
  `model.rope_scaling.*` (hf_rope.py). Refused: `attention_bias`, `moe_layer_freq` != 1, `scoring_func`
  other than sigmoid, `topk_method` other than noaux_tc, a `quantization_config` other than the published
  fine-grained fp8 (e4m3 with block scales: dequantized to bf16 on import, hf_fp8.py).
* GLM-4.5: standard attention with `partial_rotary_factor` (`model.rotary_percent`, transformers'
  default 0.5), q/k/v biases iff `attention_bias` (`model.qkv_bias`; o_proj has none), per-head
  q/k RMSNorm iff `use_qk_norm` (`model.qk_norm: head`). `rope_scaling` refused.
* Multi-token prediction (DeepSeek-V3 §2.2, model/mtp.py): depth k (0-based) is HF layer
  `num_hidden_layers + k`, which transformers skips on load:

      mtp.k.enorm / hnorm / eh_proj [h, 2h]  <-> model.layers.<L>.enorm / hnorm / eh_proj ([emb; hidden] both)
      mtp.k.layer.*                          <-> model.layers.<L>.* as any layer
      mtp.k.final_norm                       <-> model.layers.<L>.shared_head.norm
      (shared) embedding, output layer       <-> model.layers.<L>.embed_tokens, shared_head.head: copies

  Import takes the `num_nextn_predict_layers` modules whose tensors the checkpoint holds (none held:
  `model.mtp_depth` 0, said on stderr; override `model.mtp_depth=0` to leave them out), and refuses
  copies that differ from the shared tensors. Export writes the copies.
"""
from __future__ import annotations

import sys
from typing import Callable, Dict, Iterator, List, Tuple

import torch

from megatron_moe.config.schema import Config
from megatron_moe.convert.hf_common import (Family, HFReader, Tensors, base_hf_config, base_overrides, layer_from_hf,
                                            layer_to_hf, norm_topk, num_experts)
from megatron_moe.convert.hf_rope import rope_parameters, rope_scaling_hf


def _bool(value) -> str:
    return str(bool(value)).lower()


# -- config.json <-> overrides -------------------------------------------------------------------
def _moe_overrides(hf: dict) -> List[str]:
    """The routing and FFN keys both families share (sigmoid + bias, groups, shared experts)."""
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"scoring_func={hf['scoring_func']!r} is not supported (sigmoid)")
    if hf.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError(f"topk_method={hf['topk_method']!r} is not supported (noaux_tc, transformers' routing)")
    if hf.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"moe_layer_freq={hf['moe_layer_freq']} is not supported (transformers ignores it: 1)")
    quant = hf.get("quantization_config")
    if quant and (not isinstance(quant, dict) or quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") != "e4m3"):
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        raise ValueError(f"quantization_config (quant_method={method!r}) is not supported: fine-grained fp8 (e4m3, "
                         "block scales; dequantized on import: hf_fp8.py) or unquantized weights")
    shared = hf.get("n_shared_experts") or 0
    if shared < 1:
        raise ValueError(f"n_shared_experts={shared} is not supported (at least one shared expert)")
    groups = hf.get("n_group") or 1
    first_k = min(hf.get("first_k_dense_replace") or 0, hf["num_hidden_layers"])
    return [f"model.ffn_hidden_size={hf['intermediate_size']}",
            f"moe.num_experts={num_experts(hf, 'n_routed_experts')}",
            f"moe.expert_ffn_hidden_size={hf['moe_intermediate_size']}", "moe.layer_freq=1",
            f"moe.first_k_dense={first_k}", "moe.score_function=sigmoid", "moe.expert_bias=true",
            f"moe.topk_scaling_factor={float(hf.get('routed_scaling_factor', 1.0))}",
            f"moe.norm_topk_prob={_bool(hf.get('norm_topk_prob', True))}",
            f"moe.router_groups={groups}", f"moe.router_group_topk={hf['topk_group'] if groups > 1 else 'null'}",
            f"moe.shared_expert_ffn_hidden_size={shared * hf['moe_intermediate_size']}", "moe.shared_expert_gate=false",
            f"model.mtp_depth={hf.get('num_nextn_predict_layers') or 0}",
            f"moe.aux_loss_coeff={float(hf.get('router_aux_loss_coef', hf.get('aux_loss_alpha', 0.0)))}"]


def _deepseek_overrides(hf: dict) -> List[str]:
    if hf.get("attention_bias"):
        raise ValueError("attention_bias=true is not supported (biases on q_a / kv_a / o_proj)")
    heads = hf["num_attention_heads"]
    if (hf.get("num_key_value_heads") or heads) != heads:
        raise ValueError(f"num_key_value_heads={hf['num_key_value_heads']} is not supported with MLA (= heads)")
    mla = [f"model.{k}={hf[k]}" for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")]
    return base_overrides(hf, yarn=True, mla=True) + _moe_overrides(hf) + mla + [
        "model.attention=mla", f"model.q_lora_rank={hf.get('q_lora_rank') or 'null'}", "model.head_dim=null",
        "model.num_query_groups=null", "model.qk_norm=none", "model.qkv_bias=false"]


def _glm_overrides(hf: dict) -> List[str]:
    rope = rope_parameters(hf)
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))  # transformers' default
    return base_overrides(hf, partial=True) + _moe_overrides(hf) + [
        f"model.rotary_percent={float(partial)}", f"model.qkv_bias={_bool(hf.get('attention_bias'))}",
        "model.attention_output_bias=false", f"model.qk_norm={'head' if hf.get('use_qk_norm') else 'none'}"]


def _moe_hf(family: Family, cfg: Config) -> dict:
    m, moe = cfg.model, cfg.moe
    out = base_hf_config(family, cfg)
    groups = moe.router_groups
    out.update({"intermediate_size": m.ffn_hidden_size, "moe_intermediate_size": moe.expert_ffn_hidden_size,
                "n_routed_experts": moe.num_experts,
                "n_shared_experts": moe.shared_expert_ffn_hidden_size // moe.expert_ffn_hidden_size,
                "routed_scaling_factor": moe.topk_scaling_factor, "norm_topk_prob": norm_topk(cfg),
                "n_group": groups, "topk_group": moe.router_group_topk if groups > 1 else 1,
                "first_k_dense_replace": moe.first_k_dense, "num_nextn_predict_layers": m.mtp_depth,
                "rope_parameters": rope_scaling_hf(cfg)})
    return out


def _deepseek_hf(cfg: Config) -> dict:
    m = cfg.model
    out = _moe_hf(DEEPSEEK_V3, cfg)
    out.update({"q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim,
                "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim, "head_dim": m.qk_rope_head_dim,
                "num_key_value_heads": m.num_attention_heads, "rope_interleave": True, "attention_bias": False,
                "scoring_func": "sigmoid", "topk_method": "noaux_tc"})
    return out


def _glm_hf(cfg: Config) -> dict:
    m = cfg.model
    out = _moe_hf(GLM4_MOE, cfg)
    out["rope_parameters"]["partial_rotary_factor"] = m.rotary_percent
    out.update({"partial_rotary_factor": m.rotary_percent, "attention_bias": bool(m.qkv_bias),
                "use_qk_norm": m.qk_norm == "head"})
    return out


def _moe_check(cfg: Config, name: str) -> List[Tuple[bool, str]]:
    m, moe = cfg.model, cfg.moe
    f, shared = moe.expert_ffn_hidden_size or m.ffn_hidden_size, moe.shared_expert_ffn_hidden_size
    return [(moe.score_function == "sigmoid", f"moe.score_function={moe.score_function} ({name} routes by sigmoid)"),
            (moe.expert_bias, f"moe.expert_bias=false ({name} selects with e_score_correction_bias)"),
            (moe.layer_freq == 1 and moe.layer_pattern is None,
             f"moe.layer_freq={moe.layer_freq} / moe.layer_pattern ({name}: first_k_dense dense, then all MoE)"),
            (moe.expert_ffn_hidden_size is not None,
             f"moe.expert_ffn_hidden_size=null ({name}: moe_intermediate_size)"),
            (bool(shared) and shared % f == 0 and not moe.shared_expert_gate,
             f"moe.shared_expert_ffn_hidden_size={shared} / shared_expert_gate={moe.shared_expert_gate} "
             f"({name}: n_shared_experts ungated experts of moe.expert_ffn_hidden_size)"),
            (not m.attention_output_bias, f"model.attention_output_bias=true ({name}: no o_proj bias)")]


_MOE_ALLOWS = ("moe.score_function", "moe.expert_bias", "moe.router_groups", "moe.topk_scaling_factor",
               "model.mtp_depth", "moe.first_k_dense")


def _deepseek_check(cfg: Config):
    m = cfg.model
    return _moe_check(cfg, "DeepSeek-V3") + [
        (m.attention == "mla", f"model.attention={m.attention} (DeepSeek-V3: mla)")]


def _glm_check(cfg: Config):
    m = cfg.model
    return _moe_check(cfg, "GLM-4.5") + [
        (m.qk_norm in ("none", "head"), f"model.qk_norm={m.qk_norm} (GLM-4.5: none or head, use_qk_norm)")]


# -- multi-head latent attention tensors ------------------------------------------------------------
def _rope_order(rope: int) -> torch.Tensor:
    """HF interleaved rope rows -> our rotate-half rows: (0, 2, 4, .., 1, 3, 5, ..)."""
    return torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])


def _heads_rope(w: torch.Tensor, cfg: Config, order: torch.Tensor) -> torch.Tensor:
    """q_up / q `[heads (nope + rope), in]` with each head's rope rows reordered by `order`."""
    m = cfg.model
    per = w.view(m.num_attention_heads, m.qk_nope_head_dim + m.qk_rope_head_dim, -1)
    nope, rope = per.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=1)
    return torch.cat([nope, rope[:, order]], dim=1).reshape(w.shape)


def _kv_rope(w: torch.Tensor, cfg: Config, order: torch.Tensor) -> torch.Tensor:
    """kv_down `[kv_lora_rank + rope, h]` with the rope rows reordered by `order`."""
    latent, rope = w.split([cfg.model.kv_lora_rank, cfg.model.qk_rope_head_dim])
    return torch.cat([latent, rope[order]])


_MLA = (("q_down", "q_a_proj"), ("q_down_norm", "q_a_layernorm"), ("q_up", "q_b_proj"), ("q", "q_proj"),
        ("kv_down", "kv_a_proj_with_mqa"), ("kv_down_norm", "kv_a_layernorm"), ("kv_up", "kv_b_proj"))


def _mla_to_hf(cfg: Config, ours: Tensors, src: str, dst: str) -> Iterator[Tuple[str, torch.Tensor]]:
    back = torch.argsort(_rope_order(cfg.model.qk_rope_head_dim))  # our rows -> interleaved (rope_interleave: true)
    for name, theirs in _MLA:
        key = src + f"attention.{name}.weight"
        if key in ours:
            w = ours[key]
            w = _heads_rope(w, cfg, back) if name in ("q_up", "q") else \
                _kv_rope(w, cfg, back) if name == "kv_down" else w
            yield dst + f"self_attn.{theirs}.weight", w
    yield dst + "self_attn.o_proj.weight", ours[src + "attention.proj.weight"]


def _mla_from_hf(cfg: Config, hf: Callable[[str], torch.Tensor], src: str, dst: str, hf_config=None) -> Tensors:
    interleaved = True if hf_config is None else hf_config.get("rope_interleave", True)  # transformers' default
    order = _rope_order(cfg.model.qk_rope_head_dim) if interleaved else torch.arange(cfg.model.qk_rope_head_dim)
    query = ("q_down", "q_down_norm", "q_up") if cfg.model.q_lora_rank is not None else ("q",)
    names = [n for n in _MLA if n[0] in query or n[0].startswith("kv")]
    out = {}
    for name, theirs in names:
        w = hf(src + f"self_attn.{theirs}.weight")
        out[dst + f"attention.{name}.weight"] = _heads_rope(w, cfg, order) if name in ("q_up", "q") else \
            _kv_rope(w, cfg, order) if name == "kv_down" else w
    out[dst + "attention.proj.weight"] = hf(src + "self_attn.o_proj.weight")
    return out


# -- multi-token prediction ---------------------------------------------------------------------------
_MTP = (("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"), ("eh_proj.weight", "eh_proj.weight"),
        ("final_norm.weight", "shared_head.norm.weight"))


def _head(cfg: Config, ours: Tensors) -> torch.Tensor:
    return ours["embedding.word.weight"] if cfg.model.tie_embeddings else ours["output.weight"]


def _mtp_to_hf(family: Family, cfg: Config, outer: Tensors, k: int, depth: Tensors) -> Iterator[Tuple[str, torch.Tensor]]:
    """HF layer num_layers + k of our MTP depth k (`depth`: at least its `mtp.k.*` weights; `outer`: the
    embedding and output layer)."""
    i, src = cfg.model.num_layers + k, f"mtp.{k}."
    layer = {f"layers.{i}." + n[len(src + "layer."):]: t for n, t in depth.items() if n.startswith(src + "layer.")}
    yield from layer_to_hf(family, cfg, layer, i)
    dst = f"model.layers.{i}."
    for ours, theirs in _MTP:
        yield dst + theirs, depth[src + ours]
    yield dst + "embed_tokens.weight", outer["embedding.word.weight"]
    yield dst + "shared_head.head.weight", _head(cfg, outer)


def _mtp_from_hf(family: Family, cfg: Config, reader: HFReader) -> Tensors:
    from megatron_moe.model.transformer import moe_layer_flags

    m, out = cfg.model, {}
    flags = moe_layer_flags(cfg)
    shared = {"embed_tokens.weight": "model.embed_tokens.weight",
              "shared_head.head.weight": "model.embed_tokens.weight" if m.tie_embeddings else "lm_head.weight"}
    for k in range(m.mtp_depth):
        i, dst = m.num_layers + k, f"mtp.{k}."
        layer = layer_from_hf(family, cfg, reader.get, i, flags[i], reader.config)
        out.update({dst + "layer." + n[len(f"layers.{i}."):]: t for n, t in layer.items()})
        src = f"model.layers.{i}."
        out.update({dst + ours: reader.get(src + theirs) for ours, theirs in _MTP})
        for copy, main in shared.items():  # copies of the shared embedding / head: must equal them
            if reader.has(src + copy):
                if not torch.equal(reader.get(src + copy), reader.get(main, use=False)):
                    raise ValueError(f"{reader.path}: {src + copy} differs from {main}, which our MTP shares; "
                                     "override model.mtp_depth=0 to leave the MTP modules out")
    held = _held_depth(reader)
    left = [n for n in reader.weight_map for k in range(m.mtp_depth, held)
            if n.startswith(f"model.layers.{m.num_layers + k}.")]
    if left:
        reader.used.update(left)
        print(f"note: leaving out {held - m.mtp_depth} MTP module(s) of {reader.path} "
              f"(layers {m.num_layers + m.mtp_depth}..{m.num_layers + held - 1}; model.mtp_depth={m.mtp_depth})",
              file=sys.stderr)
    return out


def _held_depth(reader: HFReader) -> int:
    """The MTP modules (of config.json's num_nextn_predict_layers) whose projection the checkpoint holds."""
    n, layers = reader.config.get("num_nextn_predict_layers") or 0, reader.config["num_hidden_layers"]
    held = 0
    while held < n and reader.has(f"model.layers.{layers + held}.eh_proj.weight"):
        held += 1
    return held


def _tensor_overrides(reader: HFReader) -> List[str]:
    """`model.mtp_depth`: the MTP modules the checkpoint holds (transformers' saves hold none)."""
    n, held = reader.config.get("num_nextn_predict_layers") or 0, _held_depth(reader)
    if held < n:
        print(f"note: {reader.path} holds {held} of num_nextn_predict_layers={n} MTP modules: model.mtp_depth={held}",
              file=sys.stderr)
    return [f"model.mtp_depth={held}"]


_NAMES = ("gate_proj", "up_proj", "down_proj")
_HOOKS: Dict[str, Callable] = dict(mtp_to_hf=_mtp_to_hf, mtp_from_hf=_mtp_from_hf, tensor_overrides=_tensor_overrides)
DEEPSEEK_V3 = Family("deepseek_v3", "DeepseekV3ForCausalLM", "mlp", _NAMES, _deepseek_check, _deepseek_hf,
                     _deepseek_overrides, allows=_MOE_ALLOWS + ("model.attention", "model.rope_scaling"),
                     shared_expert="shared_experts", attention_to_hf=_mla_to_hf, attention_from_hf=_mla_from_hf,
                     **_HOOKS)
GLM4_MOE = Family("glm4_moe", "Glm4MoeForCausalLM", "mlp", _NAMES, _glm_check, _glm_hf, _glm_overrides,
                  allows=_MOE_ALLOWS + ("model.rotary_percent",), shared_expert="shared_experts", **_HOOKS)
