"""gpt-oss's attention variants (transformers' `GptOssAttention`), used by model/attention.py.

* Sliding-window attention (`model.sliding_window` W; Beltagy et al. 2020 §3.1, Mistral 7B): query
  i sees the keys i - W < j <= i (its own included: W keys), as transformers' masking utils define
  it (`sliding_window_overlay`: kv_idx > q_idx - W, and causal). `model.layer_types` says per layer
  `sliding_attention` or `full_attention` (gpt-oss: alternating, sliding first); null = every
  layer sliding once W is set. Causal attention only (BERT refuses it).
* Attention sinks (`model.attention_sinks`; Xiao et al. 2024, "StreamingLLM" §3.2, as gpt-oss
  learns them): a learned logit s_h per head joins each row's softmax denominator and attends to
  nothing,

      p_ij = exp(z_ij) / (exp(s_h) + sum_j' exp(z_ij'))

  (transformers' `eager_attention_forward` appends s_h as an extra column and drops it after the
  softmax; here the same in log space: p = exp(z - logaddexp(logsumexp_j z, s_h)), fp32). The
  parameter `sinks` `[heads]` is sharded over TP by head (TP rank r holds its heads' logits). SDPA
  takes no sinks, so `SelfAttention` computes the softmax explicitly whenever sinks are on (also on
  CUDA and in bf16: `core_attention`'s CPU backward never sees them).
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_moe.config.errors import ConfigError
from megatron_moe.config.schema import ModelConfig
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.tensor_parallel.param_meta import ParamMeta, make_param

LAYER_TYPES = ("sliding_attention", "full_attention")  # model.layer_types entries (HF's names)


def check_attention_variants(cfg: ModelConfig) -> None:
    """One-line errors for `model.sliding_window`, `model.layer_types` and `model.attention_sinks`."""
    if cfg.attention != "standard" and (cfg.sliding_window is not None or cfg.attention_sinks):
        raise ConfigError(f"model.sliding_window / model.attention_sinks need model.attention=standard, "
                          f"not {cfg.attention}")
    if cfg.sliding_window is not None and cfg.sliding_window < 1:
        raise ConfigError(f"model.sliding_window={cfg.sliding_window} must be >= 1 (or null: full attention)")
    if cfg.layer_types is None:
        return
    if cfg.sliding_window is None:
        raise ConfigError("model.layer_types needs model.sliding_window (the window of its sliding_attention layers)")
    if len(cfg.layer_types) != cfg.num_layers:
        raise ConfigError(f"model.layer_types has {len(cfg.layer_types)} entries, model.num_layers={cfg.num_layers}")
    wrong = [t for t in cfg.layer_types if t not in LAYER_TYPES]
    if wrong:
        raise ConfigError(f"model.layer_types entry {wrong[0]!r} must be one of {', '.join(LAYER_TYPES)}")


def layer_window(cfg: ModelConfig, layer_index: int, causal: bool) -> Optional[int]:
    """The sliding window W of layer `layer_index`, or None for full attention."""
    window = cfg.sliding_window
    if window is not None and cfg.layer_types is not None and cfg.layer_types[layer_index] == "full_attention":
        window = None
    if window is not None and not causal:
        raise ConfigError(f"model.sliding_window={window} needs causal attention (BERT is bidirectional): "
                          "set it to null")
    return window


def allowed_keys(s: int, causal: bool, window: Optional[int], padding_mask: Optional[torch.Tensor],
                 device: torch.device) -> Optional[torch.Tensor]:
    """Bool `[b|1, 1, s, s]`, True where query i may attend to key j (causal: j <= i; window W:
    also j > i - W; padding_mask `[b, s]`: key j real); None if all may."""
    allowed = None
    if causal:
        allowed = torch.ones(s, s, dtype=torch.bool, device=device).tril()
        if window is not None:
            allowed = allowed.triu(1 - window)  # j - i >= 1 - W
        allowed = allowed[None, None]
    if padding_mask is not None:
        keys = padding_mask.bool()[:, None, None, :]  # [b, 1, 1, s]
        allowed = keys if allowed is None else allowed & keys
    return allowed


def build_sinks(cfg: ModelConfig, state: ParallelState) -> Optional[torch.nn.Parameter]:
    """The sink logits `[heads/tp]` (N(0, init_std), as transformers initializes gpt-oss's), or None."""
    if not cfg.attention_sinks:
        return None
    meta = ParamMeta("dense", (cfg.num_attention_heads,), [(0, "tp")], std=cfg.init_std, role="bias")
    return make_param(meta, state)


def softmax_with_sinks(scores: torch.Tensor, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """fp32 scores `[b, heads, s, s]` (masked entries -inf) -> probabilities `[b, heads, s, s]`:
    the softmax over keys, with each head's sink logit in the denominator (module docstring)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.float().view(1, -1, 1, 1)  # [1, heads, 1, 1]
    total = torch.logaddexp(torch.logsumexp(scores, dim=-1, keepdim=True), sink)  # log denominator [b, heads, s, 1]
    return torch.exp(scores - total)
