"""Rotary position embedding, RoPE (Su et al. 2021, "RoFormer", Eq. 34), rotate-half layout.

Dimension pair (i, i + d/2) of each head is rotated by angle pos * theta^(-2i/d). Applied to queries
and keys only; needs an even head dimension (checked by config validation).
"""
from __future__ import annotations

from typing import Tuple

import torch


def rotary_cos_sin(seq_len: int, head_dim: int, theta: float,
                   device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[seq_len, head_dim]` (fp32) for positions 0..seq_len-1."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)  # [d/2]
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)  # [s, d/2]
    angles = torch.cat([angles, angles], dim=-1)  # [s, d]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x [b, heads, s, d]` by position; cos/sin `[s, d]`. Computed in fp32, returns x's dtype."""
    x32 = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)  # rotate_half(x)
    return (x32 * cos + rotated * sin).to(x.dtype)
