"""MoELayer: route -> place (balancer.plan) -> dispatch -> experts -> combine (DESIGN.md §4).

`forward(x [b, s, h]) -> (y [b, s, h], aux_loss)`; x and y are replicated across the TP group.
`aux_loss` is the coefficient-weighted load-balancing + z loss of this rank's data-parallel
micro-batch (identical on its TP ranks). The schedule (`moe.schedule`) and the balancer
(`moe.balancer`) come from their registries; `last_stats` describes the latest forward.

Gradient contract (what the trainer must do, and what every schedule guarantees):

* Every rank back-propagates (its micro-batch loss) / num_micro_batches, where its micro-batch
  loss includes this layer's `aux_loss`.
* Then the trainer all-reduces SUMs and divides by dp_size: dense params (the router weight) over
  `dp`, expert params (w1, w2, b1, b2) over `edp`.
* Result: every gradient equals the single-process reference gradient of the mean loss over all
  data-parallel micro-batches (and num_micro_batches accumulation steps), for each shard.

Why it holds. The router weight is replicated across TP; each TP rank routes, combines and
back-propagates its own copy of the micro-batch, so it holds the full gradient of its micro-batch
loss (identical across TP; averaging over `tp` keeps it so). An expert shard's gradient sums the
contributions of every token row it computed. Over all `edp` replicas, each data-parallel
micro-batch's tokens are computed once per TP rank (the baseline's redundancy), so the schedule
multiplies expert weight gradients by `expert_grad_scale` = 1/N_MP inside the layer (identity
forward); schedules without redundant compute (Parm S1/S2) use 1. After SUM over `edp` / dp_size
this is the mean over micro-batches. Input gradients dx are complete on every TP rank.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from megatron_moe.config.schema import Config
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.moe.balancers import BALANCERS
from megatron_moe.moe.experts import Experts
from megatron_moe.moe.router import GATES
from megatron_moe.moe.schedules import SCHEDULES
from megatron_moe.moe.stats import MoEStats


class MoELayer(torch.nn.Module):
    def __init__(self, cfg: Config, state: ParallelState, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.router = GATES.get(cfg.moe.gate)(cfg, state)
        self.experts = Experts(cfg, state)
        self.schedule = SCHEDULES.get(cfg.moe.schedule)(cfg, state)
        self.balancer = BALANCERS.get(cfg.moe.balancer)(cfg, state)
        self.last_stats: Optional[MoEStats] = None

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        b, s, h = x.shape
        routed = self.schedule.route(self.router, x.reshape(b * s, h))
        placement = self.schedule.place(routed, self.balancer)
        y = self.schedule.run(routed, placement, self.experts)  # [b*s, h]
        self.last_stats = self.schedule.stats(routed, placement)
        return y.to(x.dtype).view(b, s, h), routed.routing.aux_loss
