"""FasterMoE's topology-aware gate (He et al., PPoPP'22, §4.3; `moe.gate: topology`). Opt-in: it
changes routing (and so the model), unlike every schedule and balancer.

With M ranks per node (`parallel.ranks_per_node`) and W_net / W_local the inter- over intra-node
bandwidth (`moe.topology_gate.bandwidth_ratio`), a rank's all-to-all takes about as long over the
network as inside its node when at most

    L = W_net / (M W_local) x B                      (B: the rank's token-expert assignments)

of its assignments go to other nodes. The gate computes the usual softmax top-k; if more than L
of the chosen (token, expert) pairs are on another node, the L with the highest scores go, and
every other one re-selects its best expert on its own node that the token has not chosen yet (if
the node has none left, it keeps its choice). Combine weights are then computed from the final
choices as usual (Switch: the probability; k > 1: renormalized over the k choices), and the
aux loss counts the final choices.

Where a token is and where an expert is: a token belongs to its micro-batch, whose node is that of
the first rank of its TP group; an expert is where its owner sits in that rank's EP group. Every
TP rank of a micro-batch therefore makes the same choice (the baseline and S2 route the whole
micro-batch on each of them). Parm's S1 gates each TP rank's piece separately and is refused
with this gate (`config/validate.py`); `auto` gates the whole micro-batch and works.
"""
from __future__ import annotations

import math
from typing import Tuple

import torch

from megatron_moe.moe.router import GATES, Router
from megatron_moe.config.errors import ConfigError
from megatron_moe.config.validate import section_check


def topology_select(probs: torch.Tensor, top_k: int, remote: torch.Tensor, budget: int
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    """probs [n, E], remote Bool[E] (expert on another node), budget L -> (expert_ids [n, k] by
    descending probability, combine weights [n, k]) per the module docstring."""
    chosen = torch.topk(probs, top_k, dim=-1).indices  # best fit [n, k]
    off_node = remote[chosen]  # [n, k]
    # no branch on the off-node count (a host read): within the budget every off-node choice is
    # among the `budget` allowed, nothing is demoted and the re-sort keeps top-k's order
    scores = torch.where(off_node, probs.gather(1, chosen), torch.full_like(probs[:, :top_k], -1.0)).flatten()
    allowed = torch.argsort(scores, descending=True, stable=True)[:budget]  # highest scores, earlier tokens first
    demoted = off_node.flatten().clone()
    demoted[allowed] = False
    demoted = demoted.view_as(off_node)  # [n, k] choices that must re-select locally
    local = probs.masked_fill(remote, float("-inf")).scatter(1, chosen, float("-inf"))
    alternatives, alternative_ids = torch.topk(local, top_k, dim=-1)  # best local experts not chosen yet
    rank = (demoted.long().cumsum(1) - 1).clamp(min=0)  # i-th demoted slot of a token takes alternative i
    usable = demoted & torch.isfinite(alternatives.gather(1, rank))
    chosen = torch.where(usable, alternative_ids.gather(1, rank), chosen)
    chosen = chosen.gather(1, torch.argsort(probs.gather(1, chosen), dim=1, descending=True, stable=True))
    weights = probs.gather(1, chosen)
    if top_k > 1:
        weights = weights / weights.sum(-1, keepdim=True)
    return chosen, weights


@GATES.register("topology")
class TopologyRouter(Router):
    """Softmax top-k limited to L off-node assignments per rank (module docstring)."""

    def __init__(self, cfg, state):
        super().__init__(cfg, state)
        layout, first = state.layout, state.tp.ranks[0]
        ep_members = layout.group_of("ep", first)  # global ranks by EP rank, as the micro-batch sees them
        owners = [ep_members[e // (self.num_experts // state.ep_size)] for e in range(self.num_experts)]
        self.register_buffer("remote", torch.tensor([layout.node_of(r) != layout.node_of(first) for r in owners]),
                             persistent=False)
        self.fraction = cfg.moe.topology_gate.bandwidth_ratio / (layout.ranks_per_node or layout.world_size)

    def select(self, logits: torch.Tensor):
        probs = torch.softmax(logits, dim=-1)
        budget = math.floor(self.fraction * logits.shape[0] * self.top_k)
        expert_ids, weights = topology_select(probs, self.top_k, self.remote.to(logits.device), budget)
        return probs, expert_ids, weights


@section_check("moe.topology_gate")
def _check_topology_gate(cfg, world_size: int) -> None:
    moe = cfg.moe
    if moe.gate == "topology" and moe.schedule == "s1":
        raise ConfigError("moe.gate=topology does not work with moe.schedule=s1 (S1 gates each TP rank's piece "
                          "separately; the gate's budget covers the whole micro-batch): use s2 or auto")
    if moe.topology_gate.bandwidth_ratio <= 0:
        raise ConfigError(f"moe.topology_gate.bandwidth_ratio={moe.topology_gate.bandwidth_ratio} must be > 0")
