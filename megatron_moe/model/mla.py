"""Multi-head latent attention, MLA (DeepSeek-V2 §2.1, Eq. 9-19; DeepSeek-V3 §2.1.1, Eq. 1-11):
`model.attention: mla`.

Per token h_t `[h]`, with n_h heads of query/key width d_nope + d_rope and value width d_v:

    c_q = RMSNorm(W_DQ h)                       q_down [q_lora_rank, h], q_down_norm     (Eq. 6)
    [q^C_i | q^R_i] = W_UQ c_q                  q_up [heads (d_nope + d_rope), q_lora_rank] (Eq. 7-8)
    [c_kv | k^R] = W_DKV h                      kv_down [kv_lora_rank + d_rope, h]       (Eq. 1, 3)
    [k^C_i | v_i] = W_UKV RMSNorm(c_kv)         kv_down_norm, kv_up [heads (d_nope + d_v), kv_lora_rank] (Eq. 2, 5)
    q_i = [q^C_i ; RoPE(q^R_i)],  k_i = [k^C_i ; RoPE(k^R)]   (k^R: one head shared by all, Eq. 3-4, 9)
    o_i = softmax(q_i k_i^T x scale) v_i,  u = W_O [o_1 .. o_nh]   proj [h, heads d_v]   (Eq. 10-11)

Without `model.q_lora_rank` (DeepSeek-V2-Lite) the query is one projection `q` [heads (d_nope +
d_rope), h]. Parameter rows follow HF `DeepseekV3Attention` (q_a_proj, q_a_layernorm, q_b_proj,
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj): per head `[nope | rope]` in q_up / q,
`[latent | rope]` in kv_down, per head `[k_nope | v]` in kv_up. Rotary is our rotate-half layout on
the rope part only, tables `qk_rope_head_dim` wide (model/attention.py `rotary_tables`); HF's
`rope_interleave: true` (pairs (2i, 2i+1)) is the conversion's business: it permutes the rope rows
of q_up / q (per head) and of kv_down to rotate-half order (0, 2, 4, .., 1, 3, 5, ..), which gives
the same scores, so the model has one layout. The softmax scale is (d_nope + d_rope)^-1/2 x
mscale(s, mscale_all_dim)^2 with YaRN (HF `DeepseekV3Attention.scaling`; model/rotary.py
`yarn_softmax_factor`), the factor folded into q so that every core path keeps its default scale.
No biases on the q / kv projections (DeepSeek's `attention_bias: false`); the output projection's
per `model.attention_output_bias` / `model.bias` as the standard attention's. The two RMSNorms use
`model.norm_eps` (HF builds them with 1e-6, DeepSeek's `rms_norm_eps`).

Tensor parallel (as Megatron-Core's MLA): q_up / q and kv_up are column-parallel by heads, proj
row-parallel, so rank r computes heads r n_h / tp .. (r + 1) n_h / tp and one all-reduce forms the
output. q_down, kv_down and their norms are replicated (ParamMeta without shards: the grad sync
averages them over tp and the grad norm counts them once). Their gradients are whole on every TP
rank without any extra all-reduce of the weights: the input gradients of the up-projections'
latents are all-reduced by the column-parallel layers' `copy_to_tp_region` before they reach the
norms and down projections, and k^R, which every rank's heads use directly, goes through
`copy_to_tp_region` here (its gradient summed over the ranks' heads). So each rank back-propagates
the full gradient of the down projections' outputs, and x's gradient is whole too
(tests/distributed/test_tensor_parallel.py checks every rank's gradients against one process).

The core is SelfAttention's (`_attend`, model/core_attention.py: SDPA, the CPU bf16 backward,
dropout from the TP-sharded generator, selective recompute, Lancet's batch parts) with per-head
k and v (no grouping) and q/k width d_nope + d_rope != d_v (core_attention falls back to SDPA where
its CPU kernel needs equal widths). Refused with mla: `model.qk_norm`, `model.num_query_groups`,
`model.head_dim`, `model.qkv_bias`, `model.rotary_percent` < 1, learned positions (here), attention
sinks and sliding windows (model/attention_variants.py).
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_moe.config.errors import ConfigError
from megatron_moe.config.schema import Config, ModelConfig
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.attention import ATTENTIONS, SelfAttention, rotary_tables
from megatron_moe.model.norm import RMSNorm
from megatron_moe.model.recompute import recomputed
from megatron_moe.model.rotary import RotaryTables, apply_rotary, check_rotary, yarn_softmax_factor
from megatron_moe.tensor_parallel import (ColumnParallelLinear, Dropout, DropoutRNG, ReplicatedLinear,
                                          RowParallelLinear, copy_to_tp_region)

MLA_KEYS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")  # required with mla


@ATTENTIONS.register("mla")
class MultiLatentAttention(SelfAttention):
    """MLA (module docstring). Subclasses SelfAttention for its core paths only (`_attend`, `fused`,
    `_allowed`, `_dropping`): the projections are its own."""

    window = None  # no sliding window, no sinks (refused by `check_config`)
    sinks = None

    def __init__(self, cfg: ModelConfig, state: ParallelState, rng: DropoutRNG, *, output_std: float,
                 causal: bool = True, recompute: bool = False, rotary: Optional[RotaryTables] = None,
                 layer_index: int = 0):
        torch.nn.Module.__init__(self)
        h, heads, std = cfg.hidden_size, cfg.num_attention_heads, cfg.init_std
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.head_dim = self.nope + self.rope  # q / k width: the core's scores are scaled by head_dim^-1/2
        self.local_heads, self.per_group = heads // state.tp_size, 1
        self.causal, self.tp = causal, state.tp
        self.rotary = rotary if rotary is not None else rotary_tables(cfg)
        self.softmax_factor = yarn_softmax_factor(cfg.rope_scaling)
        qk_rows = heads * (self.nope + self.rope)
        self.q_lora = cfg.q_lora_rank is not None
        if self.q_lora:
            self.q_down = ReplicatedLinear(h, cfg.q_lora_rank, state, bias=False, std=std)
            self.q_down_norm = RMSNorm(cfg.q_lora_rank, state, eps=cfg.norm_eps)
            self.q_up = ColumnParallelLinear(cfg.q_lora_rank, qk_rows, state, bias=False, std=std)
        else:
            self.q = ColumnParallelLinear(h, qk_rows, state, bias=False, std=std)
        self.kv_down = ReplicatedLinear(h, cfg.kv_lora_rank + self.rope, state, bias=False, std=std)
        self.kv_down_norm = RMSNorm(cfg.kv_lora_rank, state, eps=cfg.norm_eps)
        self.kv_up = ColumnParallelLinear(cfg.kv_lora_rank, heads * (self.nope + self.v_dim), state, bias=False, std=std)
        proj_bias = cfg.bias if cfg.attention_output_bias is None else cfg.attention_output_bias
        self.proj = RowParallelLinear(heads * self.v_dim, h, state, bias=proj_bias, std=output_std)
        self.attn_dropout = Dropout(cfg.dropout, rng, "sharded")
        self.rng, self.recompute = rng, recompute

    def forward(self, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None, cache=None) -> torch.Tensor:
        """x `[b, s, h]` replicated; padding_mask `[b, s]` or None; `cache`: this layer's KV cache when
        decoding (megatron_moe/generation.py: it keeps the per-head k and v). Returns `[b, s, h]` replicated."""
        b, s, _ = x.shape
        heads, nope, rope = self.local_heads, self.nope, self.rope
        q = self.q_up(self.q_down_norm(self.q_down(x))) if self.q_lora else self.q(x)  # [b, s, heads/tp (nope + rope)]
        q_nope, q_pe = q.view(b, s, heads, nope + rope).split([nope, rope], dim=-1)
        latent, k_pe = self.kv_down(x).split([self.kv_lora_rank, rope], dim=-1)  # [b, s, kv_lora_rank], [b, s, rope]
        k_nope, v = self.kv_up(self.kv_down_norm(latent)).view(b, s, heads, nope + self.v_dim).split(
            [nope, self.v_dim], dim=-1)  # [b, s, heads/tp, nope | v]
        k_pe = copy_to_tp_region(k_pe, self.tp).unsqueeze(2)  # [b, s, 1, rope]: its gradient summed over TP
        pe = torch.cat([q_pe, k_pe], dim=2)  # queries and the key in one pass
        if cache is not None:  # each sequence's positions: cos / sin rows [b s, rope]
            cos, sin = cache.rotary_rows(self.rotary)
            pe = apply_rotary(pe.flatten(0, 1), cos, sin, seq_dim=0).view(pe.shape)
        else:
            cos, sin = self.rotary(s)
            pe = apply_rotary(pe, cos, sin, seq_dim=1)
        q_pe, k_pe = pe.split([heads, 1], dim=2)
        q = torch.cat([q_nope, q_pe], dim=-1)  # [b, s, heads/tp, nope + rope]
        if self.softmax_factor != 1.0:
            q = q * self.softmax_factor
        k = torch.cat([k_nope, k_pe.expand(b, s, heads, rope)], dim=-1)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, heads/tp, s, nope + rope | v]
        allowed = None
        if cache is not None:  # the cached k, v [b, heads/tp, T, nope + rope | v] and the mask [b, 1, s, T]
            k, v, allowed = cache.update(k, v)
        fused = self.fused(q)
        if self.recompute and cache is None:
            context = recomputed(self._attend, self.rng, x.device, q, k, v, padding_mask, fused)  # [b, heads/tp, s, v]
        else:
            context = self._attend(q, k, v, padding_mask, fused, allowed)
        return self.proj(context.transpose(1, 2).reshape(b, s, heads * self.v_dim))

    @staticmethod
    def check_config(config: Config) -> None:
        """MLA's keys (one-line ConfigErrors); replaces the standard attention's rules."""
        cfg, tensor = config.model, config.parallel.tensor
        missing = [f"model.{k}" for k in MLA_KEYS if getattr(cfg, k) is None]
        if missing:
            raise ConfigError(f"model.attention=mla needs {', '.join(missing)}")
        refused = {"model.qk_norm": cfg.qk_norm != "none", "model.num_query_groups": cfg.num_query_groups is not None,
                   "model.head_dim": cfg.head_dim is not None, "model.qkv_bias": bool(cfg.qkv_bias)}
        for key, set_ in refused.items():
            if set_:
                raise ConfigError(f"{key} is not supported with model.attention=mla (leave it at its default)")
        if cfg.position_embedding != "rope":
            raise ConfigError("model.attention=mla needs model.position_embedding=rope (its decoupled rotary keys)")
        if cfg.rotary_percent != 1.0:
            raise ConfigError("model.rotary_percent must be 1 with model.attention=mla (qk_rope_head_dim is the rotary part)")
        for key in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim") + (("q_lora_rank",) if cfg.q_lora_rank is not None else ()):
            if getattr(cfg, key) < 1:
                raise ConfigError(f"model.{key}={getattr(cfg, key)} must be >= 1")
        if cfg.qk_nope_head_dim < 0:
            raise ConfigError(f"model.qk_nope_head_dim={cfg.qk_nope_head_dim} must be >= 0")
        if cfg.qk_rope_head_dim % 2:
            raise ConfigError(f"model.qk_rope_head_dim={cfg.qk_rope_head_dim} must be even (rotary pairs)")
        check_rotary(cfg.rope_scaling, 1.0, cfg.qk_rope_head_dim, cfg.qk_rope_head_dim)
        if cfg.num_attention_heads % tensor:
            raise ConfigError(f"parallel.tensor={tensor} does not divide model.num_attention_heads={cfg.num_attention_heads}")
