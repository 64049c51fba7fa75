"""The attention core softmax(q k^T / sqrt(d)) v: torch SDPA, with a faster backward for bf16 on the CPU.

On CUDA `SelfAttention` calls `fused_attention`: one SDPA call with the mask, the dropout (from
the model's TP-sharded generator) and un-repeated grouped-query K/V. Elsewhere, without dropout,
`core_attention` calls `F.scaled_dot_product_attention` everywhere but in one case: bf16 on the CPU
(where `training.precision=bf16` trains with AMX), causal or unmasked, sequences of at most
`MAX_RECOMPUTE_SEQ`, gradients wanted. There the forward is the same flash kernel (the same output,
bit for bit), and the backward recomputes the probabilities from the forward's log-sum-exp, as
FlashAttention-2's backward does (Dao 2023, Algorithm 2), here per chunk of heads and per block of
whole query rows:

    P  = exp(scale q k^T - lse)          [heads, s, s]  fp32, causal entries above the diagonal 0
    D  = rowsum(dO * O)                  [heads, s, 1]  fp32
    dS = scale P * (dO v^T - D)          [heads, s, s]  fp32, then bf16
    dV = P^T dO,  dQ = dS k,  dK = dS^T q               bf16 GEMMs (fp32 accumulation)

q k^T and dO v^T are fp32 GEMMs of the bf16 inputs (exact products, fp32 sums, no bf16 rounding of
the scores, as in the flash kernel; torch has no bf16 -> fp32 GEMM on the CPU). Causal rows of
query block i need keys up to the block's end only: the blocks above the diagonal are not computed.
Why: torch 2.13's CPU flash backward takes ~5x its forward in bf16, longer than in fp32; forward +
backward here take 0.56-0.92x of flash's (docs/performance.md "bf16"), and its gradients are at
least as close to float64 as flash's (tests/unit/test_model.py). Slower than flash from s ~ 1024
on, and its memory is O(s^2) per chunk where flash's is O(s): hence `MAX_RECOMPUTE_SEQ`.

The exponent is clamped to [`EXP_FLOOR`, 0] before `exp`: the vectorized exp takes slow paths for
-inf (7x slower per element here), for results that underflow to 0 (28x), for results in the
denormal range (140x) and for ones that overflow. exp(-80) ~ 1.8e-35 is a normal float that moves
no row sum (every row has an entry >= 1/s); the clamp at 0 moves only rounding (the log-sum-exp
bounds every score it summed); the entries above the diagonal, whose exponents may be anything,
are then set to 0.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

MAX_RECOMPUTE_SEQ = 512  # longer ones keep the flash backward: faster from ~512 on, and O(s) memory
EXP_FLOOR = -80.0
_BLOCKS = 4  # query blocks per sequence, the causal skip's granularity: 10 / 16 of the full work
_HEADS_BYTES = 2 << 20  # heads per chunk: their two bf16 [s, s] buffers fit in ~2 MiB (an L2)


def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """q, k, v `[b, heads, s, d]` -> `[b, heads, s, d]`, without mask or dropout (module docstring)."""
    if (q.device.type == "cpu" and q.dtype == torch.bfloat16 and q.shape[2] <= MAX_RECOMPUTE_SEQ
            and q.shape[-1] == v.shape[-1]  # the CPU flash kernel takes one head width (MLA's v differs)
            and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        return _FlashRecomputedBackward.apply(q, k, v, causal)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask=None,
                    dropout_p: float = 0.0, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """The CUDA path (`SelfAttention`): one SDPA call with the mask, the dropout and grouped-query
    attention inside. q `[b, heads, s, d]`, k, v `[b, G, s, d]` un-repeated (`enable_gqa`: the
    flash kernel reads key/value head j // (heads / G) for query head j; fp32 and masked calls,
    which flash does not take, go to the math kernel, which repeats them itself), mask `[b|1, 1, s,
    s]` bool or None -> `[b, heads, s, d]`. Dropout draws from `generator` (a torch.Generator on
    q's device): SDPA draws from the device's default generator, so `generator`'s state is swapped in
    for the call and taken back after it, as Megatron's CUDA RNG tracker forks its states."""
    def call(p: float) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal and mask is None,
                                              enable_gqa=True)
    if dropout_p == 0.0:
        return call(0.0)
    default = torch.cuda.default_generators[q.device.index] if q.device.type == "cuda" else torch.default_generator
    outside = default.get_state()
    default.set_state(generator.get_state())
    try:
        return call(dropout_p)
    finally:
        generator.set_state(default.get_state())
        default.set_state(outside)


class _FlashRecomputedBackward(torch.autograd.Function):
    """Forward: torch's CPU flash kernel, keeping its log-sum-exp. Backward: `attention_backward`."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        ctx.save_for_backward(q, k, v, out, lse)  # lse [b, heads, s] fp32
        ctx.causal = causal
        return out

    @staticmethod
    def backward(ctx, grad):
        return (*torch.ops.megatron_moe.attention_backward(grad, *ctx.saved_tensors, ctx.causal), None)


@torch.library.custom_op("megatron_moe::attention_backward", mutates_args=())
def attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, causal: bool
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv `[b, heads, s, d]` (contiguous) of the attention core (module docstring). A custom
    op, so that `training.compile` calls it as one kernel instead of tracing its loops."""
    b, heads, s, d = q.shape
    rows, scale = b * heads, d ** -0.5
    q, k, v, grad = (x.reshape(rows, s, d) for x in (q, k, v, grad))  # [b heads, s, d] bf16
    lse = lse.reshape(rows, s, 1)
    g32 = grad.float()
    delta = (g32 * out.reshape(rows, s, d).float()).sum(-1, keepdim=True).mul_(scale)  # scale D  [b heads, s, 1]
    q32, k32, v32, g32 = q.float().mul_(scale), k.float(), v.float(), g32.mul_(scale)  # scale folded into q, dO
    above = torch.ones(s, s, dtype=torch.bool, device=q.device).triu_(1) if causal else None
    dq, dk, dv = (torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))
    chunk, block = min(rows, max(1, _HEADS_BYTES // (4 * s * s))), -(-s // _BLOCKS)
    # P and dS of one chunk of heads, bf16, reused by every chunk: the blocks above the diagonal
    # are never written and stay 0
    probs_buffer = q.new_zeros(chunk, s, s)
    dscores_buffer = torch.zeros_like(probs_buffer)
    for h in range(0, rows, chunk):
        hs = slice(h, h + chunk)
        probs, dscores = probs_buffer[:min(chunk, rows - h)], dscores_buffer[:min(chunk, rows - h)]
        for r0 in range(0, s, block):
            r1 = min(r0 + block, s)
            keys = r1 if causal else s  # causal: query i sees keys <= i
            p = torch.bmm(q32[hs, r0:r1], k32[hs, :keys].transpose(1, 2)).sub_(lse[hs, r0:r1])  # [chunk, r, keys]
            p = p.clamp_(EXP_FLOOR, 0.0).exp_()
            if causal:  # only the diagonal block has keys after its queries
                p[:, :, r0:].masked_fill_(above[r0:r1, r0:r1], 0.0)
            ds = torch.bmm(g32[hs, r0:r1], v32[hs, :keys].transpose(1, 2)).sub_(delta[hs, r0:r1]).mul_(p)
            probs[:, r0:r1, :keys] = p
            dscores[:, r0:r1, :keys] = ds
        torch.bmm(probs.transpose(1, 2), grad[hs], out=dv[hs])
        torch.bmm(dscores, k[hs], out=dq[hs])
        torch.bmm(dscores.transpose(1, 2), q[hs], out=dk[hs])
    shape = (b, heads, s, d)
    return dq.view(shape), dk.view(shape), dv.view(shape)


@attention_backward.register_fake
def _(grad, q, k, v, out, lse, causal):
    return tuple(q.new_empty(q.shape) for _ in range(3))
