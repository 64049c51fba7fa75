"""Rotary settings of Hugging Face `config.json` <-> `model.rope_theta` / `model.rope_scaling`
(config/schema.py RopeScalingConfig): YaRN (Peng et al. 2023) as transformers'
`_compute_yarn_parameters` reads it (DeepSeek-V3, Kimi K2, gpt-oss); other types are refused."""
from __future__ import annotations

from typing import List

from megatron_moe.config.schema import Config


def rope_parameters(hf: dict) -> dict:
    """config.json's rotary settings in one dict: transformers 5's `rope_parameters`, or the older
    `rope_scaling` (`type` or `rope_type`) with `rope_theta` / `partial_rotary_factor` beside it. A
    yarn one's `original_max_position_embeddings` as transformers' `standardize_rope_params` sets it:
    a top-level key first, then its own, then `max_position_embeddings`."""
    rope = dict(hf.get("rope_scaling") or {}, **(hf.get("rope_parameters") or {}))
    if hf.get("partial_rotary_factor") is not None:  # top level (older configs): transformers moves it in
        rope.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
    if rope.get("rope_type", rope.get("type")) == "yarn":
        original = hf.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
        rope["original_max_position_embeddings"] = original or hf.get("max_position_embeddings")
    return rope


def rope_scaling_overrides(rope: dict) -> List[str]:
    """`model.rope_scaling.*` of a YaRN `rope_parameters` / `rope_scaling` (Peng et al. 2023) as
    transformers' `_compute_yarn_parameters` reads it; refuses another type or a key we lack by name.
    transformers scales cos / sin by mscale(s, mscale) / mscale(s, mscale_all_dim) only when both are
    non-zero, else by mscale(s, 1), and DeepSeek-V3's softmax by mscale(s, mscale_all_dim)^2 whenever
    mscale_all_dim is non-zero: an absent key is 0 here (model/rotary.py does the same)."""
    kind = rope.get("rope_type", rope.get("type"))
    if kind != "yarn":
        raise ValueError(f"rope_scaling type={kind!r} is not supported (default or yarn)")
    if rope.get("attention_factor") is not None:
        raise ValueError(f"rope_scaling attention_factor={rope['attention_factor']} is not supported "
                         "(derived from factor, mscale, mscale_all_dim)")
    return ["model.rope_scaling.type=yarn", f"model.rope_scaling.factor={float(_needs(rope, 'factor'))}",
            "model.rope_scaling.original_max_position_embeddings="
            f"{int(_needs(rope, 'original_max_position_embeddings'))}",
            f"model.rope_scaling.beta_fast={float(rope.get('beta_fast') or 32)}",
            f"model.rope_scaling.beta_slow={float(rope.get('beta_slow') or 1)}",
            f"model.rope_scaling.mscale={float(rope.get('mscale') or 0.0)}",
            f"model.rope_scaling.mscale_all_dim={float(rope.get('mscale_all_dim') or 0.0)}",
            f"model.rope_scaling.truncate={str(bool(rope.get('truncate', True))).lower()}"]


def _needs(rope: dict, key: str):
    if rope.get(key) is None:
        raise ValueError(f"rope_scaling has no {key!r}, which yarn needs")
    return rope[key]


def rope_scaling_hf(cfg: Config) -> dict:
    """Our `model.rope_scaling` as config.json's `rope_parameters` (with rope_theta), type yarn or default."""
    r, theta = cfg.model.rope_scaling, cfg.model.rope_theta
    if r.type == "none":
        return {"rope_type": "default", "rope_theta": theta}
    return {"rope_type": "yarn", "rope_theta": theta, "factor": r.factor, "beta_fast": r.beta_fast,
            "beta_slow": r.beta_slow, "mscale": r.mscale, "mscale_all_dim": r.mscale_all_dim,
            "original_max_position_embeddings": r.original_max_position_embeddings, "truncate": r.truncate}
