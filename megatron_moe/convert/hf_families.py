"""The Hugging Face MoE families we convert, by `config.json`'s `model_type` (docs/checkpoints.md)."""
from __future__ import annotations

from megatron_moe.convert.hf_common import Family
from megatron_moe.convert.hf_mixtral import MIXTRAL
from megatron_moe.convert.hf_olmoe import OLMOE
from megatron_moe.convert.hf_qwen_moe import QWEN2_MOE, QWEN3_MOE

FAMILIES = {family.model_type: family for family in (MIXTRAL, QWEN2_MOE, QWEN3_MOE, OLMOE)}


def family_of(model_type) -> Family:
    if model_type not in FAMILIES:
        raise ValueError(f"config.json model_type={model_type!r} is not supported; supported: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[model_type]
