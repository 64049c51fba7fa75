"""Megatron's conjugate f/g operators (Shoeybi et al. 2019, "Megatron-LM", §3, Fig. 3).

Each is an autograd function over the tensor-parallel group, built on the counted raw collectives
of `distributed/collectives.py`:

    copy_to_tp_region      f: identity forward,            all-reduce backward
    reduce_from_tp_region  g: all-reduce forward,          identity backward
    gather_from_tp_region     all-gather last dim forward, split (keep own slice) backward
    scatter_to_tp_region      split last dim forward,      all-gather backward

Identity backward after an all-reduce is correct because every TP rank then computes the same
downstream function of the same (replicated) value: each rank's gradient already is the full one.
On a group of size 1 all four are the identity.
"""
from __future__ import annotations

import torch

from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.parallel_state import Group


def _split_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    assert x.shape[-1] % group.size == 0, (tuple(x.shape), group.size)
    return x.chunk(group.size, dim=-1)[group.rank].contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return C.all_reduce(grad.clone(), ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return C.all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return C.all_gather(x, group, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.group), None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return C.all_gather(grad, ctx.group, dim=-1), None


def copy_to_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _ReduceFromRegion.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[..., n/tp] on each rank -> [..., n] (rank order) on every rank."""
    return x if group.size == 1 else _GatherFromRegion.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[..., n] replicated -> this rank's [..., n/tp] slice."""
    return x if group.size == 1 else _ScatterToRegion.apply(x, group)
