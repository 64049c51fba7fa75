"""Our GPT-MoE <-> Hugging Face MoE checkpoints (`config.json` + safetensors shards with an index).

One mapping for the MoE families (`hf_mixtral.py`: MixtralForCausalLM; `hf_qwen_moe.py`:
Qwen2MoeForCausalLM, Qwen3MoeForCausalLM; `hf_olmoe.py`: OlmoeForCausalLM; `hf_deepseek.py`:
DeepseekV3ForCausalLM, Glm4MoeForCausalLM; `hf_gpt_oss.py`: GptOssForCausalLM; looked up by
`config.json`'s `model_type` in `hf_families.py`); a `Family` names its module prefixes, config
keys, the options it has and its hooks for what the standard layer lacks. Tensors are mapped on full (global) weights,
one layer at a time, in each family's original per-expert naming (the layout of the released
checkpoints; transformers loads it directly):

    embedding.word.weight [V, h]            <-> model.embed_tokens.weight
    layers.i.attention_norm.weight          <-> model.layers.i.input_layernorm.weight
    layers.i.attention.qkv.weight / .bias   <-> self_attn.q_proj / k_proj / v_proj: our rows are
                                                [group, (q_1 .. q_{heads/G} | k | v), d] (attention.py)
    layers.i.attention.q_norm / k_norm      <-> self_attn.q_norm / k_norm (`model.qk_norm`)
    layers.i.attention.proj.weight          <-> self_attn.o_proj.weight
    layers.i.attention.proj.bias, .sinks    <-> self_attn.o_proj.bias, self_attn.sinks [heads] (gpt-oss)
    layers.i.ffn_norm.weight                <-> model.layers.i.post_attention_layernorm.weight
    layers.i.ffn.router.weight [E, h]       <-> <moe>.gate.weight (gpt-oss: Family.moe_to_hf / moe_from_hf map
                                                its router and fused experts, hf_gpt_oss.py)
    layers.i.ffn.experts.w1 [E, h, 2, f]    <-> <moe>.experts.j.<gate> = w1[j][:, 0]^T, <up> = w1[j][:, 1]^T
    layers.i.ffn.experts.w2 [E, f, h]       <-> <moe>.experts.j.<down> = w2[j]^T
    layers.i.ffn.shared_expert.mlp.fc1 / fc2 <-> mlp.shared_expert.gate_proj, up_proj / down_proj (Qwen2-MoE)
    layers.i.ffn.shared_expert.gate [1, h]  <-> mlp.shared_expert_gate.weight
    layers.i.ffn.fc1 [2, f, h] / fc2 [h, f] <-> mlp.gate_proj, up_proj / down_proj (dense layers)
    final_norm.weight, output.weight        <-> model.norm.weight, lm_head.weight (untied)

Both sides use the rotate-half RoPE convention over the same head dims (rotary.py, HF
`rotate_half`), so q/k rows need no permutation. Export streams: it reads one layer's global
tensors (or one multi-token prediction module's) from the checkpoint (any layout: tensor, expert,
expert shards, pipeline, vExpert slots, ZeRO-1 all store tensors by global identity) and appends them to safetensors shards of at most
`max_shard_bytes`, with `model.safetensors.index.json` as HF's own large checkpoints have.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from megatron_moe.config.schema import Config
from megatron_moe.convert.hf_rope import rope_parameters, rope_scaling_overrides

Tensors = Dict[str, torch.Tensor]
INDEX = "model.safetensors.index.json"
EXPORTED = "megatron_moe export-hf"  # the index metadata's "format" in our exports (is_export)


@dataclass
class Family:
    model_type: str
    architecture: str
    moe_prefix: str  # "block_sparse_moe" (Mixtral) | "mlp"
    expert_names: Tuple[str, str, str]  # (gate, up, down) projection names of one expert
    check: Callable[[Config], List[Tuple[bool, str]]]  # (ok, what) rules ours -> HF
    hf_config: Callable[[Config], dict]
    overrides: Callable[[dict], List[str]]  # config.json -> our dotted overrides
    allows: Tuple[str, ...] = ()  # keys of check_shape's common rules this family has (its `check` rules them)
    shared_expert: str = "shared_expert"  # module of the shared expert under mlp. (DeepSeek, GLM: shared_experts)
    # hooks of families with more than the standard layer (hf_deepseek.py): attention (cfg, ours, src, dst) ->
    # HF (name, tensor)s and (cfg, hf, src, dst) -> ours; `mtp_to_hf(family, cfg, outer, k, depth_k)` /
    # `mtp_from_hf(family, cfg, reader)`: the multi-token prediction modules (export: one depth k at a time,
    # `depth_k` holding its `mtp.k.*`); `tensor_overrides(reader)`: overrides that depend on the tensors held
    attention_to_hf: Optional[Callable] = None
    attention_from_hf: Optional[Callable] = None
    mtp_to_hf: Optional[Callable] = None
    mtp_from_hf: Optional[Callable] = None
    tensor_overrides: Optional[Callable] = None
    # fused router + experts (hf_gpt_oss.py): (cfg, ours, "layers.i.", "model.layers.i.<moe_prefix>.") -> HF
    # (name, tensor)s and (cfg, hf, "model.layers.i.<moe_prefix>.", "layers.i.") -> ours
    moe_to_hf: Optional[Callable] = None
    moe_from_hf: Optional[Callable] = None


def check_shape(family: Family, cfg: Config) -> None:
    """Raise ValueError naming the first option that has no equivalent in `family`."""
    m, moe = cfg.model, cfg.moe
    common = {
        "model.normalization": (m.normalization == "rmsnorm", f"model.normalization={m.normalization} ({family.architecture} uses rmsnorm)"),
        "model.activation": (m.activation == "swiglu", f"model.activation={m.activation} ({family.architecture} uses swiglu)"),
        "model.position_embedding": (m.position_embedding == "rope", f"model.position_embedding={m.position_embedding} (rope expected)"),
        "model.bias": (not m.bias, "model.bias=true (no biases but the Qwen2-MoE q/k/v ones: model.qkv_bias)"),
        "moe.capacity_factor": (moe.capacity_factor is None, f"moe.capacity_factor={moe.capacity_factor} (HF MoE models are dropless)"),
        "moe.score_function": (moe.score_function == "softmax", f"moe.score_function={moe.score_function} (softmax expected)"),
        "moe.expert_bias": (not moe.expert_bias, "moe.expert_bias=true (no expert bias in this family)"),
        "moe.router_groups": (moe.router_groups == 1, f"moe.router_groups={moe.router_groups} (no group-limited routing in this family)"),
        "moe.topk_scaling_factor": (moe.topk_scaling_factor == 1.0, f"moe.topk_scaling_factor={moe.topk_scaling_factor} (1.0 expected)"),
        "moe.gate": (moe.gate == "softmax", f"moe.gate={moe.gate} (changes routing)"),
        "model.attention": (m.attention == "standard", f"model.attention={m.attention} (standard attention in this family)"),
        "model.rotary_percent": (m.rotary_percent == 1.0, f"model.rotary_percent={m.rotary_percent} (rotary on whole heads in this family)"),
        "model.rope_scaling": (m.rope_scaling.type == "none", f"model.rope_scaling.type={m.rope_scaling.type} (no rope scaling in this family)"),
        "model.mtp_depth": (m.mtp_depth == 0, f"model.mtp_depth={m.mtp_depth} (no multi-token prediction in this family)"),
        "moe.first_k_dense": (moe.first_k_dense == 0, f"moe.first_k_dense={moe.first_k_dense} (no first-k dense layers in this family)"),
        "moe.layer_pattern": (moe.layer_pattern is None, f"moe.layer_pattern={moe.layer_pattern} (no per-layer pattern in this family)"),
        "model.attention_output_bias": (not m.attention_output_bias, "model.attention_output_bias=true (no o_proj bias in this family)"),
        "model.attention_sinks": (not m.attention_sinks, "model.attention_sinks=true (no attention sinks in this family)"),
        "model.sliding_window": (m.sliding_window is None, f"model.sliding_window={m.sliding_window} (no sliding-window attention in this family)"),
        "moe.router_bias": (not moe.router_bias, "moe.router_bias=true (no router bias in this family)"),
        "moe.expert_proj_bias": (not moe.expert_proj_bias, "moe.expert_proj_bias=true (no expert projection biases in this family)"),
        "moe.activation": (moe.activation in (None, "swiglu"), f"moe.activation={moe.activation} (swiglu experts in this family)"),
    }
    rules = [rule for key, rule in common.items() if key not in getattr(family, "allows", ())]
    for ok, what in rules + family.check(cfg):
        if not ok:
            raise ValueError(f"not {family.architecture}-shaped: {what}")


def num_experts(hf: dict, key: str = "num_experts") -> int:
    """config.json's expert count: `key` (the family's name for it) or its alias (transformers maps
    `num_experts` and `num_local_experts` to each other); a config with neither lacks `key`."""
    alias = "num_local_experts" if key == "num_experts" else "num_experts"
    return hf[alias] if key not in hf and alias in hf else hf[key]


def norm_topk(cfg: Config) -> bool:
    return cfg.moe.top_k > 1 if cfg.moe.norm_topk_prob is None else cfg.moe.norm_topk_prob


def base_hf_config(family: Family, cfg: Config) -> dict:
    """The keys every family shares."""
    from megatron_moe.model.attention import head_dim, query_groups

    m, moe = cfg.model, cfg.moe
    return {
        "architectures": [family.architecture], "model_type": family.model_type, "torch_dtype": "float32",
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads, "num_key_value_heads": query_groups(m), "head_dim": head_dim(m),
        "hidden_act": "silu", "max_position_embeddings": m.seq_length, "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "tie_word_embeddings": m.tie_embeddings, "attention_dropout": 0.0, "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": moe.aux_loss_coeff, "output_router_logits": False,
        "initializer_range": m.init_std, "use_cache": True,
    }


def base_overrides(hf: dict, **allow) -> List[str]:
    """Overrides from the keys every MoE family shares; refuses what we lack, naming the field
    (`allow`: model_overrides' flags)."""
    return model_overrides(hf, **allow) + [f"moe.top_k={hf['num_experts_per_tok']}", "moe.capacity_factor=null",
                                  f"moe.aux_loss_coeff={float(hf.get('router_aux_loss_coef', 0.01))}"]


def model_overrides(hf: dict, yarn: bool = False, mla: bool = False, partial: bool = False) -> List[str]:
    """`model.*` overrides from the keys every family, MoE or dense (hf_dense.py), shares; refuses
    what we lack, naming the field (YaRN `rope_scaling` where `yarn`, multi-head latent attention's
    ranks where `mla`, `partial_rotary_factor` where `partial`: the family maps them)."""
    heads = hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads") or heads
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported (silu)")
    rope = rope_parameters(hf)
    scaled = rope.get("rope_type", rope.get("type", "default")) != "default"
    if scaled and not yarn:
        raise ValueError(f"rope_scaling={hf.get('rope_scaling') or rope} is not supported (default rope only)")
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0 and not partial:
        raise ValueError(f"partial_rotary_factor={rope['partial_rotary_factor']} is not supported (rotary on whole heads)")
    for key in ("q_lora_rank", "kv_lora_rank"):  # multi-head latent attention (DeepSeek-V2/V3)
        if hf.get(key) and not mla:
            raise ValueError(f"{key}={hf[key]}: multi-head latent attention is not supported")
    if hf.get("use_sliding_window") or (hf.get("use_sliding_window") is None and hf.get("sliding_window")
                                       and hf["sliding_window"] < hf["max_position_embeddings"]):
        raise ValueError(f"sliding_window={hf.get('sliding_window')} attention is not supported")
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    out = [f"model.num_layers={hf['num_hidden_layers']}", f"model.hidden_size={hf['hidden_size']}",
           f"model.num_attention_heads={heads}", f"model.num_query_groups={'null' if kv == heads else kv}",
           f"model.head_dim={hf.get('head_dim') or 'null'}",
           f"model.seq_length={hf['max_position_embeddings']}", f"model.vocab_size={hf['vocab_size']}",
           "model.normalization=rmsnorm", "model.activation=swiglu", "model.position_embedding=rope",
           f"model.rope_theta={theta}", "model.bias=false", f"model.tie_embeddings={str(bool(hf.get('tie_word_embeddings', False))).lower()}",
           f"model.norm_eps={float(hf.get('rms_norm_eps', 1e-6))}",
           f"model.init_std={float(hf.get('initializer_range', 0.02))}", "model.dropout=0.0"]
    if hf.get("head_dim") in (None, hf["hidden_size"] // heads) and hf["hidden_size"] % heads == 0:
        out[4] = "model.head_dim=null"
    return out + (rope_scaling_overrides(rope) if scaled else [])


# -- tensors, one layer at a time ------------------------------------------------------------------
def _attention_to_hf(cfg: Config, ours: Tensors, src: str, dst: str) -> Iterator[Tuple[str, torch.Tensor]]:
    from megatron_moe.model.attention import head_dim, query_groups

    m = cfg.model
    heads, groups, d = m.num_attention_heads, query_groups(m), head_dim(m)
    per = heads // groups
    for kind in ("weight", "bias"):
        if src + f"attention.qkv.{kind}" not in ours:
            continue
        qkv = ours[src + f"attention.qkv.{kind}"].view(groups, per + 2, d, -1)  # [G, per + 2, d, h | 1]
        trail = () if kind == "bias" else (m.hidden_size,)
        yield dst + f"self_attn.q_proj.{kind}", qkv[:, :per].reshape(heads * d, *trail)
        yield dst + f"self_attn.k_proj.{kind}", qkv[:, per].reshape(groups * d, *trail)
        yield dst + f"self_attn.v_proj.{kind}", qkv[:, per + 1].reshape(groups * d, *trail)
    for norm in ("q_norm", "k_norm"):
        if src + f"attention.{norm}.weight" in ours:
            yield dst + f"self_attn.{norm}.weight", ours[src + f"attention.{norm}.weight"]
    yield dst + "self_attn.o_proj.weight", ours[src + "attention.proj.weight"]
    for ours_name, name in (("proj.bias", "o_proj.bias"), ("sinks", "sinks")):  # gpt-oss: o bias, sinks [heads]
        if src + "attention." + ours_name in ours:
            yield dst + "self_attn." + name, ours[src + "attention." + ours_name]


def _attention_from_hf(cfg: Config, hf: Callable[[str], torch.Tensor], src: str, dst: str, hf_config=None) -> Tensors:
    """The config decides what is read (q/k/v biases iff `model.qkv_bias`): a bias the config lacks
    is left unused (HFReader.unused), one it needs and the checkpoint lacks is named."""
    from megatron_moe.model.attention import head_dim, query_groups

    m = cfg.model
    heads, groups, d = m.num_attention_heads, query_groups(m), head_dim(m)
    per, out = heads // groups, {}
    for kind in ("weight", "bias") if m.qkv_bias else ("weight",):
        q = hf(src + f"self_attn.q_proj.{kind}").reshape(groups, per, d, -1)
        k, v = (hf(src + f"self_attn.{p}_proj.{kind}").reshape(groups, 1, d, -1) for p in "kv")
        fused = torch.cat([q, k, v], dim=1)  # [G, per + 2, d, h | 1]
        out[dst + f"attention.qkv.{kind}"] = fused.reshape((heads + 2 * groups) * d, -1).squeeze(-1) \
            if kind == "bias" else fused.reshape((heads + 2 * groups) * d, m.hidden_size)
    for norm in ("q_norm", "k_norm"):
        if m.qk_norm != "none":
            out[dst + f"attention.{norm}.weight"] = hf(src + f"self_attn.{norm}.weight")
    out[dst + "attention.proj.weight"] = hf(src + "self_attn.o_proj.weight")
    if m.attention_output_bias:
        out[dst + "attention.proj.bias"] = hf(src + "self_attn.o_proj.bias")
    if m.attention_sinks:
        out[dst + "attention.sinks"] = hf(src + "self_attn.sinks")
    return out


def _mlp_to_hf(fc1: torch.Tensor, fc2: torch.Tensor, dst: str):
    """fc1 [2, f, h] (gate, up), fc2 [h, f] -> HF gate_proj / up_proj [f, h], down_proj [h, f]."""
    yield dst + "gate_proj.weight", fc1[0]
    yield dst + "up_proj.weight", fc1[1]
    yield dst + "down_proj.weight", fc2


def layer_to_hf(family: Family, cfg: Config, ours: Tensors, i: int) -> Iterator[Tuple[str, torch.Tensor]]:
    """HF tensors of our layer i (`ours`: at least that layer's full weights)."""
    src, dst = f"layers.{i}.", f"model.layers.{i}."
    yield dst + "input_layernorm.weight", ours[src + "attention_norm.weight"]
    yield from (family.attention_to_hf or _attention_to_hf)(cfg, ours, src, dst)
    yield dst + "post_attention_layernorm.weight", ours[src + "ffn_norm.weight"]
    if src + "ffn.router.weight" not in ours:  # a dense layer
        yield from _mlp_to_hf(ours[src + "ffn.fc1.weight"], ours[src + "ffn.fc2.weight"], dst + "mlp.")
        return
    moe = dst + family.moe_prefix + "."
    if family.moe_to_hf is not None:
        yield from family.moe_to_hf(cfg, ours, src, moe)
        return
    yield moe + "gate.weight", ours[src + "ffn.router.weight"]
    if src + "ffn.router.expert_bias" in ours:  # DeepSeek-V3's aux-loss-free bias (a buffer in transformers)
        yield moe + "gate.e_score_correction_bias", ours[src + "ffn.router.expert_bias"]
    w1, w2 = ours[src + "ffn.experts.w1"], ours[src + "ffn.experts.w2"]  # [E, h, 2, f], [E, f, h]
    gate, up, down = family.expert_names
    for j in range(w1.shape[0]):
        e = moe + f"experts.{j}."
        yield e + gate + ".weight", w1[j][:, 0].t()
        yield e + up + ".weight", w1[j][:, 1].t()
        yield e + down + ".weight", w2[j].t()
    if src + "ffn.shared_expert.mlp.fc1.weight" in ours:
        yield from _mlp_to_hf(ours[src + "ffn.shared_expert.mlp.fc1.weight"], ours[src + "ffn.shared_expert.mlp.fc2.weight"],
                              dst + f"mlp.{family.shared_expert}.")
    if src + "ffn.shared_expert.gate" in ours:
        yield dst + "mlp.shared_expert_gate.weight", ours[src + "ffn.shared_expert.gate"]


def layer_from_hf(family: Family, cfg: Config, hf: Callable[[str], torch.Tensor], i: int, is_moe: bool,
                  hf_config: dict = None) -> Tensors:
    """Our full weights of layer i from HF tensors (`hf(name)` reads one); the config decides which
    (and `hf_config`, config.json, how a family hook reads them)."""
    src, dst = f"model.layers.{i}.", f"layers.{i}."
    out = {dst + "attention_norm.weight": hf(src + "input_layernorm.weight"),
           dst + "ffn_norm.weight": hf(src + "post_attention_layernorm.weight")}
    out.update((getattr(family, "attention_from_hf", None) or _attention_from_hf)(cfg, hf, src, dst, hf_config))
    if not is_moe:
        out[dst + "ffn.fc1.weight"] = torch.stack([hf(src + "mlp.gate_proj.weight"), hf(src + "mlp.up_proj.weight")])
        out[dst + "ffn.fc2.weight"] = hf(src + "mlp.down_proj.weight")
        return out
    moe, (gate, up, down) = src + family.moe_prefix + ".", family.expert_names
    if family.moe_from_hf is not None:
        out.update(family.moe_from_hf(cfg, hf, moe, dst))
        return out
    out[dst + "ffn.router.weight"] = hf(moe + "gate.weight")
    if cfg.moe.expert_bias:
        out[dst + "ffn.router.expert_bias"] = hf(moe + "gate.e_score_correction_bias")
    e = moe + "experts.{}."
    num_experts = cfg.moe.num_experts
    gates = torch.stack([hf(e.format(j) + gate + ".weight").t() for j in range(num_experts)])  # [E, h, f]
    ups = torch.stack([hf(e.format(j) + up + ".weight").t() for j in range(num_experts)])
    out[dst + "ffn.experts.w1"] = torch.stack([gates, ups], dim=2)  # [E, h, 2, f]
    out[dst + "ffn.experts.w2"] = torch.stack([hf(e.format(j) + down + ".weight").t() for j in range(num_experts)])
    if cfg.moe.shared_expert_ffn_hidden_size:
        shared = src + f"mlp.{family.shared_expert}."
        out[dst + "ffn.shared_expert.mlp.fc1.weight"] = torch.stack([hf(shared + "gate_proj.weight"),
                                                                     hf(shared + "up_proj.weight")])
        out[dst + "ffn.shared_expert.mlp.fc2.weight"] = hf(shared + "down_proj.weight")
    if cfg.moe.shared_expert_gate:
        out[dst + "ffn.shared_expert.gate"] = hf(src + "mlp.shared_expert_gate.weight")
    return out


def outer_to_hf(cfg: Config, ours: Tensors) -> Iterator[Tuple[str, torch.Tensor]]:
    yield "model.embed_tokens.weight", ours["embedding.word.weight"]
    yield "model.norm.weight", ours["final_norm.weight"]
    if not cfg.model.tie_embeddings:
        yield "lm_head.weight", ours["output.weight"]


def outer_from_hf(cfg: Config, hf: Callable[[str], torch.Tensor]) -> Tensors:
    out = {"embedding.word.weight": hf("model.embed_tokens.weight"), "final_norm.weight": hf("model.norm.weight")}
    if not cfg.model.tie_embeddings:
        out["output.weight"] = hf("lm_head.weight")
    return out


def import_overrides(family, reader: "HFReader") -> List[str]:
    """config.json's overrides, then those that depend on the tensors the checkpoint holds."""
    extra = getattr(family, "tensor_overrides", None)
    return family.overrides(reader.config) + (extra(reader) if extra is not None else [])


def mtp_from_hf(family, cfg: Config, reader: "HFReader") -> Tensors:
    """Our multi-token prediction modules' weights (none where the family has none)."""
    read = getattr(family, "mtp_from_hf", None)
    return read(family, cfg, reader) if read is not None else {}


# -- files ---------------------------------------------------------------------------------------
def write_hf(path: str, family: Family, cfg: Config, outer: Tensors, layer: Callable[[int], Tensors],
             max_shard_bytes: int = 5 << 30, dtype: torch.dtype = torch.float32,
             mtp: Optional[Callable[[int], Tensors]] = None) -> None:
    """HF directory `path` from our full weights: `outer` (embedding, final norm, output layer),
    `layer(i)` (at least layer i's) and `mtp(k)` (at least MTP depth k's `mtp.k.*`; default: from
    `outer`), fetched one layer at a time; tensors stored in `dtype` (`config.json`'s `torch_dtype`)."""
    check_shape(family, cfg)
    writer = ShardWriter(path, max_shard_bytes, dtype)
    for i in range(cfg.model.num_layers):
        for name, tensor in layer_to_hf(family, cfg, layer(i), i):
            writer.add(name, tensor)
    for k in range(cfg.model.mtp_depth if family.mtp_to_hf is not None else 0):
        for name, tensor in family.mtp_to_hf(family, cfg, outer, k, (mtp or (lambda _: outer))(k)):
            writer.add(name, tensor)
    for name, tensor in outer_to_hf(cfg, outer):
        writer.add(name, tensor)
    writer.close(dict(family.hf_config(cfg), torch_dtype=str(dtype).split(".")[-1]))


class ShardWriter:
    """Tensors appended one by one, cast to `dtype`, into `model-0000k-of-0000n.safetensors` shards
    of at most `max_shard_bytes` each (a bigger tensor gets a shard of its own) + the index."""

    def __init__(self, path: str, max_shard_bytes: int, dtype: torch.dtype = torch.float32):
        self.path, self.max_bytes, self.dtype = path, max_shard_bytes, dtype
        self.pending: Tensors = {}
        self.pending_bytes, self.files, self.weight_map, self.total = 0, [], {}, 0
        os.makedirs(path, exist_ok=True)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.to(self.dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous().clone()  # own storage: no view of a whole layer
        self.pending_bytes += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        name = f"shard-{len(self.files) + 1}.tmp"
        save_file(self.pending, os.path.join(self.path, name), metadata={"format": "pt"})
        self.files.append((name, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self, config: dict) -> None:
        if self.pending:
            self._flush()
        n = len(self.files)
        for k, (tmp, names) in enumerate(self.files, start=1):
            final = f"model-{k:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.path, tmp), os.path.join(self.path, final))
            self.weight_map.update({t: final for t in names})
        with open(os.path.join(self.path, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": self.total, "format": EXPORTED},
                       "weight_map": dict(sorted(self.weight_map.items()))}, f, indent=2)
        with open(os.path.join(self.path, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)


def is_export(path: str) -> bool:
    """Whether directory `path` holds one export of ours and nothing else: our index, config.json,
    the shards the index lists and the tokenizer files (hf_tokenizer.FILES; export-hf replaces such
    a directory without --force)."""
    from megatron_moe.convert.hf_tokenizer import FILES

    try:
        with open(os.path.join(path, INDEX)) as f:
            index = json.load(f)
        return index["metadata"]["format"] == EXPORTED and \
            set(os.listdir(path)) <= {INDEX, "config.json", *FILES, *index["weight_map"].values()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


class ConfigJson(dict):
    """config.json's keys; a missing one the conversion needs is a ValueError naming the file and key."""

    def __init__(self, path: str):
        try:
            with open(path) as f:
                super().__init__(json.load(f))
        except (ValueError, TypeError) as exc:  # JSONDecodeError, or not an object
            raise ValueError(f"{path} is not a JSON object ({exc})") from None
        self.path = path

    def __missing__(self, key):
        needs = f", which a {self['model_type']} config needs" if "model_type" in self else ""
        raise ValueError(f"{self.path} has no {key!r}{needs}")


class MissingTensor(ValueError):
    """A tensor the HF checkpoint does not hold (HFReader.get)."""


class HFReader:
    """Lazy reader of a HF model directory: config.json, and tensors by name from the shards that
    `model.safetensors.index.json`'s weight_map lists (only those: a stale shard beside them is not
    read), or from `model.safetensors` without an index, as `from_pretrained` reads them. `unused()`:
    the tensors no `get` asked for."""

    def __init__(self, path: str):
        from safetensors import safe_open

        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"{path} has no config.json")
        self.path, self.config, self.used = path, ConfigJson(os.path.join(path, "config.json")), set()
        if os.path.isfile(os.path.join(path, INDEX)):
            self.weight_map = ConfigJson(os.path.join(path, INDEX))["weight_map"]
            if not isinstance(self.weight_map, dict):
                raise ValueError(f"{os.path.join(path, INDEX)}: weight_map is not an object")
        elif os.path.isfile(os.path.join(path, "model.safetensors")):
            self.weight_map = None
        else:
            raise ValueError(f"{path} has neither {INDEX} nor model.safetensors (pickled .bin weights are not read)")
        self.handles, names = {}, {}
        for file in sorted(set(self.weight_map.values())) if self.weight_map is not None else ["model.safetensors"]:
            try:
                self.handles[file] = safe_open(os.path.join(path, file), framework="pt")
            except Exception as exc:  # SafetensorError (truncated, bad header), a missing file
                raise ValueError(f"{os.path.join(path, file)} is not a readable safetensors file: {exc}") from None
            names[file] = set(self.handles[file].keys())
        if self.weight_map is None:
            self.weight_map = dict.fromkeys(names["model.safetensors"], "model.safetensors")
        for name, file in self.weight_map.items():
            if name not in names[file]:
                raise ValueError(f"{os.path.join(path, file)} has no tensor {name}, which {INDEX} maps to it")

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str, use: bool = True) -> torch.Tensor:
        """Tensor `name` (marked used unless `use` is false)."""
        if name not in self.weight_map:
            raise MissingTensor(f"{self.path} has no tensor {name}")
        try:
            tensor = self.handles[self.weight_map[name]].get_tensor(name)
        except Exception as exc:  # SafetensorError: data past the end of a damaged file
            raise ValueError(f"{os.path.join(self.path, self.weight_map[name])}: cannot read {name}: {exc}") from None
        if use:
            self.used.add(name)
        from megatron_moe.convert.hf_fp8 import dequantize_read

        return dequantize_read(self, name, tensor)  # FP8 block-quantized weights (DeepSeek-V3): bf16

    def unused(self) -> List[str]:
        return sorted(set(self.weight_map) - self.used)
