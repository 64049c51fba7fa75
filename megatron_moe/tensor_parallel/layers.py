"""Tensor-parallel layers (Megatron-LM §3): column- and row-parallel linear, vocab-parallel embedding,
and a replicated linear for small layers every TP rank holds whole.

Every parameter is created by `make_param` with a `ParamMeta` that states its global shape and
sharding, so `init_model_from_seed_` gives the same full weights on any tensor degree. Weights use
torch's [out, in] convention. Inputs are batch-first, `[..., features]`.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.tensor_parallel.param_meta import ParamMeta, make_param
from megatron_moe.tensor_parallel.mappings import (copy_to_tp_region, gather_from_tp_region,
                                                   reduce_from_tp_region, scatter_to_tp_region)


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """Vocabulary rounded up to a multiple of the tensor degree (rows past `vocab_size` are zeros)."""
    return -(-vocab_size // tp_size) * tp_size


class ColumnParallelLinear(torch.nn.Module):
    """y = x W^T + b with W [out, in] split on `out` across TP: Y = [Y_1 .. Y_tp] (Megatron Eq. 3).

    Input `[..., in]` replicated across TP; output `[..., out/tp]` (or `[..., out]` on every rank
    with `gather_output`). `valid_rows` marks zero padding rows of W (padded vocabulary).
    `halves=True` (SwiGLU's gate and up projections in one weight, `model/mlp.py`): W is
    [2, out, in] split on `out`, and each rank's output `[..., 2 out/tp]` is its gate half
    followed by its up half.
    """

    def __init__(self, in_features: int, out_features: int, state: ParallelState, *, bias: bool = True,
                 std: float = 0.02, gather_output: bool = False, valid_rows: Optional[int] = None,
                 halves: bool = False):
        super().__init__()
        assert not (halves and (gather_output or valid_rows)), "halves is for SwiGLU's fc1 only"
        self.group, self.gather_output = state.tp, gather_output
        out = (2, out_features) if halves else (out_features,)
        shard = [(len(out) - 1, "tp")]
        self.weight = make_param(ParamMeta("dense", out + (in_features,), shard, std=std,
                                           valid_rows=valid_rows, role="weight"), state)
        self.bias = None
        if bias:
            self.bias = make_param(ParamMeta("dense", out, shard, init="zeros", role="bias"), state)
        self.wgrad = None  # Lancet's WGradScheduler (techniques/lancet/lancet.py): dW deferred in backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp_region(x, self.group)
        if self.wgrad is not None and torch.is_grad_enabled():
            y = self.wgrad.linear(x, self.weight, self.bias)  # [..., out/tp]
        else:
            weight = self.weight.view(-1, self.weight.shape[-1])
            y = F.linear(x, weight, None if self.bias is None else self.bias.view(-1))  # [..., out/tp]
        return gather_from_tp_region(y, self.group) if self.gather_output else y


class ReplicatedLinear(torch.nn.Module):
    """y = x W^T (+ b) with W [out, in] whole on every TP rank (no shards: the grad sync averages it
    over tp, the grad norm counts it once). BERT's MLM head and pooler, MLA's down projections."""

    def __init__(self, in_features: int, out_features: int, state: ParallelState, *, bias: bool = True,
                 std: float = 0.02):
        super().__init__()
        self.weight = make_param(ParamMeta("dense", (out_features, in_features), std=std, role="weight"), state)
        self.bias = make_param(ParamMeta("dense", (out_features,), init="zeros", role="bias"), state) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(torch.nn.Module):
    """y = x W^T + b with W [out, in] split on `in` across TP: Y = sum_i X_i W_i^T (Megatron Eq. 3).

    Input `[..., in/tp]` (or `[..., in]` replicated, scattered here when `input_is_parallel=False`);
    output `[..., out]` all-reduced, identical on every TP rank. The bias is replicated and added
    once, after the reduction.
    """

    def __init__(self, in_features: int, out_features: int, state: ParallelState, *, bias: bool = True,
                 std: float = 0.02, input_is_parallel: bool = True):
        super().__init__()
        self.group, self.input_is_parallel = state.tp, input_is_parallel
        self.weight = make_param(ParamMeta("dense", (out_features, in_features), [(1, "tp")], std=std, role="weight"),
                                 state)
        self.bias = make_param(ParamMeta("dense", (out_features,), init="zeros", role="bias"), state) if bias else None
        self.wgrad = None  # Lancet's WGradScheduler (techniques/lancet/lancet.py): dW deferred in backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.group)  # [..., in/tp]
        if self.wgrad is not None and torch.is_grad_enabled():
            y = self.wgrad.linear(x, self.weight, None)
        else:
            y = F.linear(x, self.weight)
        y = reduce_from_tp_region(y, self.group)  # [..., out]
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding table [V_padded, h] split on the vocabulary across TP (Megatron-LM §3).

    Each rank looks up the tokens in its row range [start, start + V_padded/tp), zeros the others,
    and the partial embeddings are all-reduced. Tokens `[b, s]` replicated -> `[b, s, h]` replicated.
    Rows `num_embeddings..V_padded` are zero padding (`valid_rows`).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, state: ParallelState, *, std: float = 0.02):
        super().__init__()
        self.group = state.tp
        self.num_embeddings = num_embeddings
        padded = padded_vocab_size(num_embeddings, state.tp_size)
        self.weight = make_param(ParamMeta("dense", (padded, embedding_dim), [(0, "tp")], std=std,
                                           valid_rows=num_embeddings, role="embedding"), state)
        self.vocab_start = self.weight.meta.offsets(state)[0]
        self.vocab_end = self.vocab_start + self.weight.shape[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return F.embedding(tokens, self.weight)
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)  # [b, s]
        local = (tokens - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # [b, s, h]
        return reduce_from_tp_region(partial, self.group)
