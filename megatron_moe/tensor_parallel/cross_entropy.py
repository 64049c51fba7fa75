"""Cross-entropy over vocabulary-parallel logits (Megatron-LM §3, "parallel cross entropy").

Each TP rank holds logits for its contiguous slice of the (padded) vocabulary. The loss
    loss_t = log sum_v exp(z_tv) - z_t,target
needs only three all-reduces of per-token scalars (max, sum of exp, target logit) instead of
gathering [tokens, V] logits. Backward is local: dL/dz = softmax(z) - onehot(target).

Computed in fp32 whatever the logits' dtype (bf16 runs: docs/precision.md); the gradient is
returned in the logits' dtype. The fp32 copy of the logits is the only `[tokens, V]` buffer: it is
shifted, exponentiated and normalized in place, and backward forms the gradient in it in place, as
Megatron's kernel does (a second backward through the same loss is not supported). Padded
vocabulary entries (global index >= `vocab_size`) are masked to -inf, so they
take no probability mass and the loss does not depend on the tensor degree.
"""
from __future__ import annotations

import torch

from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.parallel_state import Group


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size):
        # logits [..., V_local] (this rank's slice), target [...] global ids, replicated across TP
        v_local = logits.shape[-1]
        vocab_start = group.rank * v_local
        z = logits.to(torch.float32, copy=True)  # [..., V_local], this function's own: worked on in place
        valid_cols = vocab_size - vocab_start  # columns of this shard that are real vocabulary
        if valid_cols < v_local:
            z[..., max(valid_cols, 0):] = float("-inf")
        z_max = C.all_reduce(z.max(dim=-1).values, group, op="max")  # [...]
        z.sub_(z_max.unsqueeze(-1))

        local_target = target - vocab_start
        outside = (local_target < 0) | (local_target >= v_local)
        local_target = local_target.masked_fill(outside, 0)
        target_logit = z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        target_logit = C.all_reduce(target_logit, group)  # [...]

        exp_z = z.exp_()  # [..., V_local]
        sum_exp = C.all_reduce(exp_z.sum(dim=-1), group)  # [...]
        softmax = exp_z.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        ctx.logits_dtype = logits.dtype
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax  # [..., V_local], in place as Megatron's: backward runs once through the loss
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Group,
                                 vocab_size: int) -> torch.Tensor:
    """Per-token loss `[...]` (fp32) from vocab-parallel `logits [..., V_padded/tp]` and `target [...]`.

    `vocab_size` is the unpadded vocabulary; ids >= it must not appear in `target`.
    """
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_size)
