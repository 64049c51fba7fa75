"""The Hugging Face families we convert, by `config.json`'s `model_type` (docs/checkpoints.md): MoE
families both ways (`FAMILIES`), dense ones imported to be upcycled (`DENSE_FAMILIES`, hf_dense.py)."""
from __future__ import annotations

from typing import Union

from megatron_moe.convert.hf_common import Family
from megatron_moe.convert.hf_deepseek import DEEPSEEK_V3, GLM4_MOE
from megatron_moe.convert.hf_dense import LLAMA, MISTRAL, QWEN3, DenseFamily
from megatron_moe.convert.hf_gpt_oss import GPT_OSS
from megatron_moe.convert.hf_mixtral import MIXTRAL
from megatron_moe.convert.hf_olmoe import OLMOE
from megatron_moe.convert.hf_qwen_moe import QWEN2_MOE, QWEN3_MOE

FAMILIES = {family.model_type: family for family in (MIXTRAL, QWEN2_MOE, QWEN3_MOE, OLMOE, GPT_OSS, DEEPSEEK_V3,
                                                          GLM4_MOE)}
DENSE_FAMILIES = {family.model_type: family for family in (LLAMA, MISTRAL, QWEN3)}
# model_types whose config.json and tensors are another family's (import only; export writes that family's):
# Kimi K2 (moonshotai/Kimi-K2-*: DeepseekV3ForCausalLM through its own remote code)
IMPORT_ALIASES = {"kimi_k2": "deepseek_v3"}


def family_of(model_type) -> Family:
    """The MoE family of `model_type` (export, import)."""
    if model_type not in FAMILIES:
        raise ValueError(f"config.json model_type={model_type!r} is not supported; supported: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[model_type]


def import_family_of(model_type) -> Union[Family, DenseFamily]:
    """The MoE or dense family of `model_type` (import; an `IMPORT_ALIASES` name gives the family it names)."""
    if model_type in DENSE_FAMILIES:
        return DENSE_FAMILIES[model_type]
    model_type = IMPORT_ALIASES.get(model_type, model_type)
    if model_type not in FAMILIES:
        raise ValueError(f"config.json model_type={model_type!r} is not supported; supported: "
                         f"{', '.join(sorted(set(FAMILIES) | set(IMPORT_ALIASES)))} (MoE), "
                         f"{', '.join(sorted(DENSE_FAMILIES))} (dense, to upcycle)")
    return FAMILIES[model_type]
