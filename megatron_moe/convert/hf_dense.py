"""Dense Hugging Face families we import to upcycle into an MoE family (docs/checkpoints.md).

Sparse upcycling (Komatsuzaki et al. 2023, §3.1) of released dense checkpoints into the shape of
the MoE family built on the same blocks:

    LlamaForCausalLM (llama), MistralForCausalLM (mistral) -> MixtralForCausalLM (mixtral)
    Qwen3ForCausalLM (qwen3)                                -> Qwen3MoeForCausalLM (qwen3_moe)

Import gives our dense model (no MoE layer: `moe.layer_freq` = layers + 1) with the tensor
mapping of `hf_common.py`'s dense layers (`mlp.gate_proj | up_proj | down_proj`); `offline.upcycle`
(or `import_hf(..., num_experts=N)`) then copies each layer's FFN into every expert. The config
sets `moe.norm_topk_prob: true`, so the top-k weights sum to one and the upcycled model computes
the dense one's function whatever the router picks, for any `moe.top_k`.

Not here: Qwen2 (its MoE family, Qwen2-MoE, always has a gated shared expert: only a zeroed
one would keep the dense function, and we do not make one up); OLMo 2 / 3 (post-norm: RMSNorm
on each sublayer's output; OLMoE is pre-norm) and OLMo 1 (LayerNorm without weights; OLMoE uses
RMSNorm): no OLMo dense model has OLMoE's shape.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Tuple

from megatron_moe.config.schema import Config
from megatron_moe.convert.hf_common import model_overrides


@dataclass
class DenseFamily:
    model_type: str
    architecture: str
    upcycles_to: str  # model_type of the MoE family (hf_families.FAMILIES) an upcycled model exports to
    check: Callable[[Config], List[Tuple[bool, str]]]  # (ok, what): `hf_common.check_shape`'s family rules
    overrides: Callable[[dict], List[str]]  # config.json -> our dotted overrides


def _dense_check(qk_norm: str, name: str):
    def check(cfg: Config):
        m, moe = cfg.model, cfg.moe
        return [(m.qk_norm == qk_norm, f"model.qk_norm={m.qk_norm} ({name} has qk_norm {qk_norm})"),
                (not m.qkv_bias, f"model.qkv_bias=true ({name} has no attention biases)"),
                (moe.layer_freq > m.num_layers, f"moe.layer_freq={moe.layer_freq} ({name} is dense: no MoE layer, "
                                                "moe.layer_freq > model.num_layers; --num-experts upcycles it)"),
                (moe.shared_expert_ffn_hidden_size is None, f"moe.shared_expert_ffn_hidden_size ({name} is dense)")]
    return check


def _dense_overrides(qk_norm: str):
    def overrides(hf: dict) -> List[str]:
        for key in ("attention_bias", "mlp_bias"):
            if hf.get(key):
                raise ValueError(f"{key}=true is not supported (linear biases)")
        return model_overrides(hf) + [
            f"model.ffn_hidden_size={hf['intermediate_size']}", f"model.qk_norm={qk_norm}", "model.qkv_bias=false",
            f"moe.layer_freq={hf['num_hidden_layers'] + 1}", "moe.expert_ffn_hidden_size=null",
            "moe.shared_expert_ffn_hidden_size=null", "moe.norm_topk_prob=true", "moe.capacity_factor=null"]
    return overrides


def _family(model_type: str, architecture: str, upcycles_to: str, qk_norm: str) -> DenseFamily:
    name = architecture[:-len("ForCausalLM")]
    return DenseFamily(model_type, architecture, upcycles_to, _dense_check(qk_norm, name), _dense_overrides(qk_norm))


LLAMA = _family("llama", "LlamaForCausalLM", "mixtral", "none")
MISTRAL = _family("mistral", "MistralForCausalLM", "mixtral", "none")
QWEN3 = _family("qwen3", "Qwen3ForCausalLM", "qwen3_moe", "head")
