"""Multi-head self-attention split by heads across TP (Megatron-LM §3, Fig. 3b).

The QKV projection is column-parallel and the output projection row-parallel, so each TP rank
computes `num_attention_heads / tp` whole heads and one all-reduce forms the output. The fused QKV
weight [3h, h] orders its rows [head, (q|k|v), head_dim]: a contiguous TP shard of rows holds whole
heads, whatever the tensor degree (layout-independent initialization).

Causal (GPT) or bidirectional (BERT) with an optional key padding mask; optional rotary positions.
Without active dropout it calls torch SDPA; with attention-probability dropout in training it
computes softmax explicitly so the mask comes from the TP-sharded dropout generator
(`tensor_parallel/random.py`): each rank draws different masks for its different heads.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron_moe.config.schema import ModelConfig
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.recompute import recomputed
from megatron_moe.model.rotary import apply_rotary, rotary_cos_sin
from megatron_moe.tensor_parallel import ColumnParallelLinear, Dropout, DropoutRNG, RowParallelLinear


class SelfAttention(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, state: ParallelState, rng: DropoutRNG, *, output_std: float,
                 causal: bool = True, recompute: bool = False):
        """`recompute`: keep only q, k, v of the core attention and run it again in backward
        (`training.recompute=selective`, model/recompute.py)."""
        super().__init__()
        h = cfg.hidden_size
        self.head_dim = h // cfg.num_attention_heads
        self.local_heads = cfg.num_attention_heads // state.tp_size
        self.causal = causal
        self.rope_theta = cfg.rope_theta if cfg.position_embedding == "rope" else None
        self.qkv = ColumnParallelLinear(h, 3 * h, state, bias=cfg.bias, std=cfg.init_std)
        self.proj = RowParallelLinear(h, h, state, bias=cfg.bias, std=output_std)
        self.attn_dropout = Dropout(cfg.dropout, rng, "sharded")
        self.rng, self.recompute = rng, recompute

    def forward(self, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x `[b, s, h]` replicated; padding_mask `[b, s]` (1 = real token, 0 = padding key) or None.
        Returns `[b, s, h]` replicated."""
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, self.local_heads, 3, self.head_dim)  # [b, s, heads/tp, 3, d]
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # each [b, heads/tp, s, d]
        if self.rope_theta is not None:
            cos, sin = rotary_cos_sin(s, self.head_dim, self.rope_theta, x.device)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.recompute:
            context = recomputed(self._attend, self.rng, x.device, q, k, v, padding_mask)  # [b, heads/tp, s, d]
        else:
            context = self._attend(q, k, v, padding_mask)
        return self.proj(context.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))

    def _allowed(self, s: int, padding_mask: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
        """Bool `[b|1, 1, s, s]`, True where query i may attend to key j; None if all may."""
        allowed = None
        if self.causal:
            allowed = torch.ones(s, s, dtype=torch.bool, device=device).tril()[None, None]
        if padding_mask is not None:
            keys = padding_mask.bool()[:, None, None, :]  # [b, 1, 1, s]
            allowed = keys if allowed is None else allowed & keys
        return allowed

    def _attend(self, q, k, v, padding_mask):
        if not (self.training and self.attn_dropout.p > 0):
            if padding_mask is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self._allowed(q.shape[2], padding_mask, q.device))
        scores = (q @ k.transpose(-2, -1)) * self.head_dim ** -0.5  # [b, heads/tp, s, s]
        allowed = self._allowed(q.shape[2], padding_mask, q.device)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        probs = self.attn_dropout(torch.softmax(scores.float(), dim=-1).to(v.dtype))
        return probs @ v
