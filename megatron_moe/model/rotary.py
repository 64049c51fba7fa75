"""Rotary position embedding, RoPE (Su et al. 2021, "RoFormer", Eq. 34), rotate-half layout.

Dimension pair (i, i + d/2) of each head is rotated by angle pos * theta^(-2i/d). Applied to queries
and keys only; needs an even head dimension (checked by config validation).

`apply_rotary` rotates in fp32 whatever the input's dtype and returns the input's dtype. Eager, it
is one autograd node (`_Rotary`) over queries and keys together: per half, one product and one
`addcmul_` into a preallocated output (no `rotate_half` concatenation), and backward is the same
rotation by the negated angle (a rotation's transpose), with no autograd graph of slices, negations
and concatenations to walk back. Under `torch.compile` it is the plain formula, which Inductor fuses.

`RotaryTables` holds cos / sin for positions up to `model.seq_length`, computed once per model (one
module shared by the layers of a stage, as Megatron-Core's `RotaryEmbedding` computes them once per
forward for all layers). Recomputed in each layer's forward they cost little eagerly, but under
`training.compile` Inductor inlines their formula (`theta ** (-2i/d)`, cos, sin) into the rotary
kernel and evaluates it again for every element of queries and keys, forward and backward: powf,
cosf and sinf per element (one compiled attention sublayer, forward + backward, at
docs/performance.md's bf16 shape: 30.5 ms recomputing them, 25.6 ms with the tables).
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


class RotaryTables(torch.nn.Module):
    """cos, sin `[max_len, head_dim]` (fp32) of `rotary_cos_sin`, as non-persistent buffers: not in
    checkpoints, moved with the model, kept fp32 by `cast_params_`. `forward(seq_len)` returns the
    first `seq_len` rows (the same values `rotary_cos_sin(seq_len, ...)` computes), or computes
    them for a sequence longer than `max_len`."""

    def __init__(self, max_len: int, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        cos, sin = rotary_cos_sin(max_len, head_dim, theta, torch.device("cpu"))
        self.register_buffer("cos", cos, persistent=False)  # [max_len, d]
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, seq_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if seq_len > self.cos.shape[0]:
            return rotary_cos_sin(seq_len, self.head_dim, self.theta, self.cos.device)
        return self.cos[:seq_len], self.sin[:seq_len]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """fp32 (x1 cos - x2 sin, x2 cos + x1 sin) of x = (x1, x2) halves of the last dim; cos / sin
    `[..., d/2]` broadcast against x's halves."""
    x32 = x.float()
    half = x.shape[-1] // 2
    x1, x2 = x32[..., :half], x32[..., half:]
    out = torch.empty_like(x32)
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=o2).addcmul_(x1, sin)
    return out


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _rotate(dy, cos, -sin).to(dy.dtype), None, None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq_dim: int = -2) -> torch.Tensor:
    """Rotate `x [..., s, ..., d]` (sequence at `seq_dim`, e.g. `[b, heads, s, d]` or
    `[b, s, heads, d]`) by position; cos / sin `[s, d]` from `rotary_cos_sin`. Computed in fp32,
    returns x's dtype (module docstring)."""
    trailing = x.dim() - 1 - (seq_dim % x.dim())  # dims between the sequence and d
    shape = (cos.shape[0],) + (1,) * (trailing - 1) + (cos.shape[1],)
    if torch.compiler.is_compiling():
        x32 = x.float()
        half = x.shape[-1] // 2
        rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)  # rotate_half(x)
        return (x32 * cos.view(shape) + rotated * sin.view(shape)).to(x.dtype)
    half = cos.shape[1] // 2  # cos / sin repeat their first half (rotary_cos_sin)
    halves = (cos.shape[0],) + (1,) * (trailing - 1) + (half,)
    return _Rotary.apply(x, cos[:, :half].reshape(halves), sin[:, :half].reshape(halves))
