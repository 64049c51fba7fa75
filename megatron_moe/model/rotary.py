"""Rotary position embedding, RoPE (Su et al. 2021, "RoFormer", Eq. 34), rotate-half layout.

Dimension pair (i, i + d/2) of the rotated part of each head is rotated by angle pos * theta^(-2i/d),
d = the rotary width. Applied to queries and keys only; d must be even (checked by `check_rotary`).

Partial rotary (`model.rotary_percent`, GLM-4.5: 0.5; HF's `partial_rotary_factor`): the tables have
width d = int(head_dim * rotary_percent), and `apply_rotary` rotates only the first d dims of each
head (rotate-half within them, as HF Glm4Moe's `apply_rotary_pos_emb`) and passes the rest through.

YaRN (`model.rope_scaling.type: yarn`; Peng et al. 2023, "YaRN", §3.2 Eq. 17-20, and the attention
temperature of §3.4; DeepSeek-V3 §4.3, gpt-oss), exactly as transformers' `_compute_yarn_parameters`:
per frequency i, inv_freq = interp (1 - e) + extrap e with extrap = theta^(-2i/d), interp = extrap / s
(s = `factor`) and e = 1 - ramp(i) over the correction range [low, high] of the dims that turn
between `beta_fast` and `beta_slow` times over `original_max_position_embeddings` (bounds floored /
ceiled unless `truncate: false`, gpt-oss). cos and sin are multiplied by the attention factor
mscale(s, mscale) / mscale(s, mscale_all_dim) when both are non-zero, else mscale(s) (mscale(s, m) =
0.1 m ln s + 1, 1 for s <= 1); HF's absent `mscale` is 0 here. Multi-head latent attention scales
its softmax by mscale(s, mscale_all_dim)^2 besides (`yarn_softmax_factor`, model/mla.py).

`apply_rotary` rotates in fp32 whatever the input's dtype and returns the input's dtype. Eager, it
is one autograd node (`_Rotary`) over queries and keys together: per half, one product and one
`addcmul_` into a preallocated output (no `rotate_half` concatenation), and backward is the same
rotation by the negated angle (a rotation's transpose; with YaRN's attention factor a scaled rotation,
whose transpose is the same), with no autograd graph of slices, negations and concatenations to walk
back. Under `torch.compile` it is the plain formula, which Inductor fuses.

`RotaryTables` holds cos / sin for positions up to `model.seq_length`, computed once per model (one
module shared by the layers of a stage, as Megatron-Core's `RotaryEmbedding` computes them once per
forward for all layers). Recomputed in each layer's forward they cost little eagerly, but under
`training.compile` Inductor inlines their formula (`theta ** (-2i/d)`, cos, sin) into the rotary
kernel and evaluates it again for every element of queries and keys, forward and backward: powf,
cosf and sinf per element (one compiled attention sublayer, forward + backward, at
docs/performance.md's bf16 shape: 30.5 ms recomputing them, 25.6 ms with the tables).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from megatron_moe.config.errors import ConfigError
from megatron_moe.config.schema import RopeScalingConfig

ROPE_SCALINGS = ("none", "yarn")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 mscale ln(s) + 1 (1 for s <= 1; HF `get_mscale`)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_softmax_factor(scaling: Optional[RopeScalingConfig]) -> float:
    """The extra softmax-scale factor of multi-head latent attention: mscale(s, mscale_all_dim)^2 with
    YaRN and a non-zero `mscale_all_dim` (HF `DeepseekV3Attention.scaling`), else 1."""
    if scaling is None or scaling.type != "yarn" or not scaling.mscale_all_dim:
        return 1.0
    m = yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return m * m


def inverse_frequencies(dim: int, theta: float, scaling: Optional[RopeScalingConfig] = None
                        ) -> Tuple[torch.Tensor, float]:
    """(inv_freq `[dim/2]` fp32, the attention factor multiplying cos / sin): plain RoPE, or YaRN
    (module docstring; HF `_compute_yarn_parameters` step for step, so the same fp32 values)."""
    if scaling is None or scaling.type == "none":
        return theta ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim), 1.0
    s = scaling
    if s.mscale and s.mscale_all_dim:
        attention_factor = float(yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim))
    else:
        attention_factor = yarn_mscale(s.factor)

    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times over the context
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: prevent a singular ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [dim/2]
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp  # HF's inv_freq_extrapolation_factor
    inv_freq = 1.0 / (s.factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation
    return inv_freq, attention_factor


def rotary_cos_sin(seq_len: int, head_dim: int, theta: float, device: torch.device,
                   scaling: Optional[RopeScalingConfig] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[seq_len, head_dim]` (fp32) for positions 0..seq_len-1; `head_dim` = the rotary width."""
    with torch.device(device):  # the tables are real even under a meta-device context (parameter counts)
        inv_freq, attention_factor = inverse_frequencies(head_dim, theta, scaling)  # [d/2]
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq.to(device))  # [s, d/2]
    angles = torch.cat([angles, angles], dim=-1)  # [s, d]
    if attention_factor == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def check_rotary(rope_scaling: RopeScalingConfig, rotary_percent: float, rotary_dim: int, head_dim: int) -> None:
    """`model.rotary_percent` and `model.rope_scaling` (one-line ConfigErrors)."""
    if not 0 < rotary_percent <= 1:
        raise ConfigError(f"model.rotary_percent={rotary_percent} must be in (0, 1]")
    if rotary_dim < 2 or rotary_dim % 2:
        raise ConfigError(f"model.position_embedding=rope needs an even rotary width >= 2, got {rotary_dim} "
                          f"(int(head dim {head_dim} x model.rotary_percent {rotary_percent}))")
    s = rope_scaling
    if s.type not in ROPE_SCALINGS:
        raise ConfigError(f"model.rope_scaling.type={s.type!r} must be one of {', '.join(ROPE_SCALINGS)}")
    if s.factor < 1:
        raise ConfigError(f"model.rope_scaling.factor={s.factor} must be >= 1")
    if s.type == "yarn" and not (s.beta_fast > 0 and s.beta_slow > 0 and s.original_max_position_embeddings > 0):
        raise ConfigError("model.rope_scaling: yarn needs beta_fast, beta_slow and original_max_position_embeddings > 0")


class RotaryTables(torch.nn.Module):
    """cos, sin `[max_len, rotary_dim]` (fp32) of `rotary_cos_sin`, as non-persistent buffers: not in
    checkpoints, moved with the model, kept fp32 by `cast_params_`. `forward(seq_len)` returns the
    first `seq_len` rows (the same values `rotary_cos_sin(seq_len, ...)` computes), or computes
    them for a sequence longer than `max_len`."""

    def __init__(self, max_len: int, head_dim: int, theta: float, scaling: Optional[RopeScalingConfig] = None):
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        cos, sin = rotary_cos_sin(max_len, head_dim, theta, torch.device("cpu"), scaling)
        self.register_buffer("cos", cos, persistent=False)  # [max_len, d]
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, seq_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if seq_len > self.cos.shape[0]:
            return rotary_cos_sin(seq_len, self.head_dim, self.theta, self.cos.device, self.scaling)
        return self.cos[:seq_len], self.sin[:seq_len]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """fp32 (x1 cos - x2 sin, x2 cos + x1 sin, x3) of x = (x1, x2, x3) along the last dim, x1 and x2
    the halves of the first 2 r dims (r = cos's last dim), x3 the rest (partial rotary, passed
    through); cos / sin `[..., r]` broadcast against x's halves."""
    x32 = x.float()
    half = cos.shape[-1]
    x1, x2 = x32[..., :half], x32[..., half:2 * half]
    out = torch.empty_like(x32)
    o1, o2 = out[..., :half], out[..., half:2 * half]
    torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=o2).addcmul_(x1, sin)
    if 2 * half < x.shape[-1]:
        out[..., 2 * half:] = x32[..., 2 * half:]
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
    """Rotate the first r dims of `x [..., s, ..., d]` (sequence at `seq_dim`, e.g. `[b, heads, s, d]`
    or `[b, s, heads, d]`) by position and pass the other d - r through; cos / sin `[s, r]` from
    `rotary_cos_sin`, r <= d (r < d: partial rotary). Computed in fp32, returns x's dtype (module
    docstring)."""
    trailing = x.dim() - 1 - (seq_dim % x.dim())  # dims between the sequence and d
    width = cos.shape[1]
    shape = (cos.shape[0],) + (1,) * (trailing - 1) + (width,)
    if torch.compiler.is_compiling():
        x32 = x.float()
        half, part = width // 2, x32[..., :width]
        rotated = torch.cat([-part[..., half:], part[..., :half]], dim=-1)  # rotate_half(x)
        y = part * cos.view(shape) + rotated * sin.view(shape)
        if width < x.shape[-1]:
            y = torch.cat([y, x32[..., width:]], dim=-1)
        return y.to(x.dtype)
    half = width // 2  # cos / sin repeat their first half (rotary_cos_sin)
    halves = (cos.shape[0],) + (1,) * (trailing - 1) + (half,)
    return _Rotary.apply(x, cos[:, :half].reshape(halves), sin[:, :half].reshape(halves))
