"""Aux-loss-free load balancing (DeepSeek-V3, Liu et al. 2024, §2.1.2; `moe.expert_bias`).

Each MoE layer's router holds a per-expert bias b `[E]` that is added to the routing scores for
the top-k *selection* only; the combine weights come from the unbiased scores (router.py). After
every training step (outside autograd), each layer's bias moves toward balanced loads:

    b_e <- b_e + rate * sign(mean_j load_j - load_e)        (rate = `moe.expert_bias_rate`, the paper's gamma)

where load_e counts the assignments to e (before capacity drops) of every micro-batch of the step
on every data-parallel rank: one all-reduce over `dp` per pipeline stage of all its layers' loads
`[L, E]`, so every rank applies the same update and the bias stays identical everywhere. The bias
is a frozen parameter (no gradient, no optimizer state, no weight decay): it travels with the
model through checkpoints, resharding and conversion like any replicated dense tensor.
"""
from __future__ import annotations

from typing import List

import torch

from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.tensor_parallel.param_meta import ParamMeta, make_param


def make_expert_bias(num_experts: int, state: ParallelState) -> torch.nn.Parameter:
    """A zero fp32 bias `[E]`, replicated, excluded from the optimizer (requires_grad False)."""
    bias = make_param(ParamMeta("dense", (num_experts,), init="zeros", role="bias"), state)
    bias.requires_grad_(False)
    return bias


class LoadCounter:
    """The assignments a router made since the last update, Long `[E]`."""

    def __init__(self):
        self.load = None

    def add(self, tokens_per_expert: torch.Tensor) -> None:
        counts = tokens_per_expert.detach().to(torch.float64)
        self.load = counts if self.load is None else self.load + counts


@torch.no_grad()
def update_expert_biases(moe_layers: List[torch.nn.Module], state: ParallelState, rate: float) -> None:
    """The step's update of every biased router among `moe_layers` (this pipeline stage's)."""
    routers = [layer.router for layer in moe_layers if layer.router.expert_bias is not None]
    if not routers:
        return
    loads = torch.stack([r.loads.load if r.loads.load is not None else torch.zeros(r.num_experts, dtype=torch.float64)
                         for r in routers]).to(routers[0].expert_bias.device)  # [L, E]
    loads = C.all_reduce(loads, state.dp, kind="expert_bias")
    for router, load in zip(routers, loads):
        router.expert_bias.add_((rate * torch.sign(load.mean() - load)).to(router.expert_bias.dtype))
        router.loads.load = None
