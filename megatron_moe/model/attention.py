"""Self-attention split by query groups across TP (Megatron-LM §3, Fig. 3b), MHA or grouped-query.

Grouped-query attention (GQA, Ainslie et al. 2023, §2.2; `model.num_query_groups` = G, null = MHA
with G = heads): the `heads` query heads share G key/value heads, heads / G queries per group.
The QKV projection is column-parallel and the output projection row-parallel, so each TP rank
computes G / tp whole groups (heads / tp query heads) and one all-reduce forms the output. The
fused QKV weight `[(heads + 2 G) d, h]` orders its rows `[group, (q_1 .. q_{heads/G} | k | v), d]`
(Megatron's GQA layout; for MHA `[head, (q|k|v), d]`): a contiguous TP shard of rows holds whole
groups, whatever the tensor degree (layout-independent initialization). Query head j uses key/value
head j // (heads / G), as in HF's `repeat_kv`. `model.head_dim` may differ from hidden / heads
(Qwen3-MoE): the output projection is then `[h, heads d]`.

Optional QK-norm (`model.qk_norm`, model/qk_norm.py) normalizes q and k before rotary positions.
Causal (GPT) or bidirectional (BERT) with an optional key padding mask; optional rotary positions.
On CUDA the core is one SDPA call with the dropout and un-repeated K/V (`enable_gqa`;
`core_attention.fused_attention`, its dropout drawn from the TP-sharded generator below). On the CPU
(and in Lancet's batch parts with dropout) the K/V heads are repeated per query head; without
active dropout it calls torch SDPA (`model/core_attention.py`: with its own backward for bf16
on the CPU); with attention-probability dropout in training it
computes softmax explicitly so the mask comes from the TP-sharded dropout generator
(`tensor_parallel/random.py`): each rank draws different masks for its different heads. Its scores
are fp32 in bf16 too, as `core_attention`'s; the probabilities are rounded to bf16 for `probs @ v`.

gpt-oss's variants (module `attention_variants` docstring: sliding windows, sinks) and biases:
`model.qkv_bias` on the QKV projection (GLM-4.5's `attention_bias`: q/k/v only), and
`model.attention_output_bias` on the output projection (`proj.bias`), each null = `model.bias`.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron_moe.config.errors import ConfigError
from megatron_moe.config.registry import Registry
from megatron_moe.config.schema import Config, ModelConfig
from megatron_moe.config.validate import section_check
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.attention_variants import (allowed_keys, build_sinks, check_attention_variants,
                                                   layer_window, softmax_with_sinks)
from megatron_moe.model.core_attention import core_attention, fused_attention
from megatron_moe.model.qk_norm import build_qk_norms, check_qk_norm
from megatron_moe.model.recompute import recomputed
from megatron_moe.model.rotary import RotaryTables, apply_rotary, check_rotary
from megatron_moe.tensor_parallel import ColumnParallelLinear, Dropout, DropoutRNG, RowParallelLinear


def head_dim(cfg: ModelConfig) -> int:
    return cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads


# model.attention: "standard" = SelfAttention (below), "mla" = model/mla.py's MultiLatentAttention;
# an entry takes SelfAttention's constructor arguments; one other than "standard" has a
# `check_config(config)` that replaces this module's rules
ATTENTIONS: Registry = Registry("model.attention")


def rotary_dim(cfg: ModelConfig) -> int:
    """Rotated dims per head: MLA's `qk_rope_head_dim`, else int(head_dim x `model.rotary_percent`)
    (HF's `partial_rotary_factor`; model/rotary.py)."""
    if cfg.attention == "mla":
        return cfg.qk_rope_head_dim
    return int(head_dim(cfg) * cfg.rotary_percent)


def rotary_tables(cfg: ModelConfig) -> Optional[RotaryTables]:
    """The rotary cos / sin tables (`rotary_dim` wide, `model.rope_scaling` applied) for
    `model.seq_length` positions (one per stage, shared by its layers: model/pipeline_stages.py), or
    None without rotary positions. The one place tables are built."""
    if cfg.position_embedding != "rope":
        return None
    return RotaryTables(cfg.seq_length, rotary_dim(cfg), cfg.rope_theta, cfg.rope_scaling)


def query_groups(cfg: ModelConfig) -> int:
    return cfg.num_query_groups or cfg.num_attention_heads


@section_check("model.attention")
def check_attention_config(config: Config, world_size: int) -> None:
    """Megatron's divisibility rules for heads, query groups and the tensor degree; `model.qk_norm`."""
    cfg, tensor = config.model, config.parallel.tensor
    if cfg.position_embedding == "rope" and cfg.attention != "mla":  # mla: its own check
        check_rotary(cfg.rope_scaling, cfg.rotary_percent, rotary_dim(cfg), head_dim(cfg))
    check_attention_variants(cfg)  # sliding windows, sinks (model/attention_variants.py)
    if cfg.attention != "standard":  # a registered name, with its own rules (model/mla.py)
        return ATTENTIONS.get(cfg.attention).check_config(config)
    heads, groups = cfg.num_attention_heads, query_groups(cfg)
    if cfg.num_query_groups is not None and cfg.num_query_groups < 1:
        raise ConfigError(f"model.num_query_groups={cfg.num_query_groups} must be >= 1 (or null for MHA)")
    if cfg.head_dim is not None and cfg.head_dim < 1:
        raise ConfigError(f"model.head_dim={cfg.head_dim} must be >= 1 (or null: hidden_size / num_attention_heads)")
    if heads % groups:
        raise ConfigError(f"model.num_query_groups={groups} does not divide model.num_attention_heads={heads}")
    if heads % tensor:
        raise ConfigError(f"parallel.tensor={tensor} does not divide model.num_attention_heads={heads}")
    if groups % tensor:
        raise ConfigError(f"parallel.tensor={tensor} does not divide model.num_query_groups={groups} "
                          "(tensor parallelism splits the query groups)")
    if cfg.head_dim is None and cfg.hidden_size % heads:
        raise ConfigError(f"model.num_attention_heads={heads} does not divide model.hidden_size={cfg.hidden_size} "
                          "(or set model.head_dim)")
    check_qk_norm(cfg)


class SelfAttention(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, state: ParallelState, rng: DropoutRNG, *, output_std: float,
                 causal: bool = True, recompute: bool = False, rotary: Optional[RotaryTables] = None,
                 layer_index: int = 0):
        """`recompute`: keep only q, k, v of the core attention and run it again in backward
        (`training.recompute=selective`, model/recompute.py). `rotary`: the stage's shared cos / sin
        tables (model.position_embedding=rope; built here when not given). `layer_index`: the
        layer's place in the model (`model.layer_types` picks its sliding window)."""
        super().__init__()
        h, heads, groups = cfg.hidden_size, cfg.num_attention_heads, query_groups(cfg)
        self.head_dim = d = head_dim(cfg)
        self.local_heads, self.local_groups = heads // state.tp_size, groups // state.tp_size
        self.per_group = heads // groups  # query heads per key/value head
        self.causal = causal
        self.rotary = None
        if cfg.position_embedding == "rope":
            self.rotary = rotary if rotary is not None else rotary_tables(cfg)
        qkv_bias = cfg.bias if cfg.qkv_bias is None else cfg.qkv_bias
        self.qkv = ColumnParallelLinear(h, (heads + 2 * groups) * d, state, bias=qkv_bias, std=cfg.init_std)
        self.q_norm, self.k_norm = build_qk_norms(cfg, state, heads, groups, d)
        proj_bias = cfg.bias if cfg.attention_output_bias is None else cfg.attention_output_bias
        self.proj = RowParallelLinear(heads * d, h, state, bias=proj_bias, std=output_std)
        self.window = layer_window(cfg, layer_index, causal)  # keys i - W < j <= i, or None
        self.sinks = build_sinks(cfg, state)  # [heads/tp] learned sink logits, or None
        self.attn_dropout = Dropout(cfg.dropout, rng, "sharded")
        self.rng, self.recompute = rng, recompute

    def forward(self, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None, cache=None) -> torch.Tensor:
        """x `[b, s, h]` replicated; padding_mask `[b, s]` (1 = real token, 0 = padding key) or None;
        `cache`: this layer's KV cache when decoding (megatron_moe/generation.py `LayerCache`: positions,
        earlier keys / values, mask). Returns `[b, s, h]` replicated."""
        b, s, _ = x.shape
        per_group, d = self.per_group, self.head_dim
        # split, not indexing: backward then concatenates the three gradients once, where
        # select / slice would each scatter into a zeroed copy of the whole QKV gradient
        qk, v = self.qkv(x).view(b, s, self.local_groups, per_group + 2, d).split([per_group + 1, 1], dim=3)
        if self.q_norm is not None:  # [b, s, G/tp, per_group | 1, d] -> normalized, concatenated again
            q, k = qk.split([per_group, 1], dim=3)
            q = self.q_norm(q.reshape(b, s, self.local_heads, d)).view(q.shape)
            qk = torch.cat([q, self.k_norm(k.squeeze(3)).unsqueeze(3)], dim=3)
        if self.rotary is not None and cache is not None:  # each sequence's positions: cos / sin rows [b s, d]
            cos, sin = cache.rotary_rows(self.rotary)
            qk = apply_rotary(qk.flatten(0, 1), cos, sin, seq_dim=0).view(qk.shape)
        elif self.rotary is not None:  # queries and keys in one pass
            cos, sin = self.rotary(s)
            qk = apply_rotary(qk, cos, sin, seq_dim=1)
        q, k = qk.split([per_group, 1], dim=3)
        q = q.reshape(b, s, self.local_heads, d)  # [b, s, heads/tp, d]
        q, k, v = q.transpose(1, 2), k.squeeze(3).transpose(1, 2), v.squeeze(3).transpose(1, 2)  # [b, heads/tp | G/tp, s, d]
        allowed = None
        if cache is not None:  # the cached keys / values [b, G/tp, T, d] and the mask [b, 1, s, T]
            k, v, allowed = cache.update(k, v, self.window)
        fused = self.fused(q)  # decided once: a recomputation in backward runs outside Lancet's batch parts
        if self.per_group > 1 and not fused:  # query head j attends with key/value head j // per_group
            k, v = k.repeat_interleave(self.per_group, dim=1), v.repeat_interleave(self.per_group, dim=1)
        if self.recompute and cache is None:
            context = recomputed(self._attend, self.rng, x.device, q, k, v, padding_mask, fused)  # [b, heads/tp, s, d]
        else:
            context = self._attend(q, k, v, padding_mask, fused, allowed)
        return self.proj(context.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))

    def _allowed(self, s: int, padding_mask: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
        """Bool `[b|1, 1, s, s]`, True where query i may attend to key j; None if all may."""
        return allowed_keys(s, self.causal, self.window, padding_mask, device)

    def _dropping(self) -> bool:
        return self.training and self.attn_dropout.p > 0

    def fused(self, q: torch.Tensor) -> bool:
        """Whether the core is one SDPA call on un-repeated K/V (`core_attention.fused_attention`):
        on CUDA, unless dropout must draw its masks here as slices of whole micro-batch ones (Lancet's
        batch parts, `DropoutRNG.batch_parts`). SDPA takes no sinks: with `model.attention_sinks` the
        explicit softmax below runs on CUDA too."""
        return (q.device.type == "cuda" and self.sinks is None
                and not (self._dropping() and self.rng.in_batch_part))

    def _attend(self, q, k, v, padding_mask, fused: bool = False, allowed=None):
        """q `[b, heads/tp, s, d]`, k, v `[b, G/tp, s, d]` when `fused` (`fused`), else `[b, heads/tp, s, d]`
        -> `[b, heads/tp, s, d]`. `allowed`: a KV cache's mask `[b, 1, s, T]` (then T keys), instead
        of the causal / window / padding one."""
        dropping = self._dropping()
        explicit = not fused and (dropping or self.sinks is not None)  # the softmax below, not an SDPA call
        mask = allowed
        if mask is None and (explicit or padding_mask is not None or self.window is not None):
            mask = self._allowed(q.shape[2], padding_mask, q.device)  # else SDPA's is_causal / no mask
        if fused:
            if not dropping:
                return fused_attention(q, k, v, self.causal, mask)
            generator = self.rng.generator(self.attn_dropout.region, q.device)
            return fused_attention(q, k, v, self.causal, mask, self.attn_dropout.p, generator)
        if not explicit:
            if mask is None:
                return core_attention(q, k, v, self.causal)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        # fp32 scores of bf16 q, k (exact products, fp32 sums), as core_attention's: rounding them to bf16
        # before the softmax moves dq ~10x more (docs/precision.md); in fp32 the same ops as before
        scores = (q.float() @ k.float().transpose(-2, -1)) * self.head_dim ** -0.5  # [b, heads/tp, s, s] fp32
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = self.attn_dropout(softmax_with_sinks(scores, self.sinks).to(v.dtype))
        return probs @ v


ATTENTIONS.register("standard")(SelfAttention)
