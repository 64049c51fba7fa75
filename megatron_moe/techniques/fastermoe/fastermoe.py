"""FasterMoE's dynamic shadowing (He et al., PPoPP'22, §4.1, Alg. 1; `moe.balancer: fastermoe`).

Per layer and forward, on the counts every rank already has (no extra communication):

    B_w  = rows EP rank w computes under the current shadow set (owners only at first)
    c_min = Lat_imbl(B_max)                                         Eq. 7
    for each expert e by descending popularity (total rows):         Alg. 1 lines 5-17
        shadow e: its owner keeps only its own sources' rows of e,  lines 6-9
                  every other EP rank computes its sources' rows of e itself
        c = Lat_shadow(|E_s| + 1, B'_max)                            Eq. 8
        if c < c_min: accept (c_min = c)  else: stop

Eq. 8 is the paper's as printed by default; `moe.fastermoe.eq8` names the alternatives
(`techniques/fastermoe/fastermoe_model.py`). The paper's Alg. 1 walks workers ("B_i, i in DescendingSort(B)")
with one expert per worker; with several experts per EP rank we walk experts by their total rows
(FastMoE's release walks them too, but prices them differently: `eq8: fastmoe`). `moe.fastermoe.min_shadow: k` shadows at least the k most popular experts whatever
the model says (experiments, tests). A shadowed expert is replicated on every EP rank of its
group (its weights are broadcast, `moe/replicas.py`) and each source computes its own rows of it
locally (`Placement.shadowed`), so the math is unchanged.
"""
from __future__ import annotations

from typing import List, Sequence

import torch

from megatron_moe.moe.balancers import BALANCERS
from megatron_moe.moe.balancers.base import REPLICA_AGG, Balancer
from megatron_moe.moe.placement import Placement
from megatron_moe.techniques.fastermoe.fastermoe_model import ShadowCostModel
from megatron_moe.perf.hardware import BALANCER_OPS, configured_profile, expert_shape
from megatron_moe.config.errors import ConfigError
from megatron_moe.config.validate import expert_proj_bias, section_check
from megatron_moe.perf.hardware import PROFILE_NEEDS
from megatron_moe.distributed.parallel_state import SIDE_CHANNELS


def rows_per_rank(counts: torch.Tensor, source_ep_ranks: Sequence[int], ep_size: int) -> torch.Tensor:
    """counts Long[S, E] -> T Long[ep, E]: rows each EP rank's sources route to each expert."""
    ranks = torch.as_tensor(list(source_ep_ranks), dtype=torch.long)
    return torch.zeros(ep_size, counts.shape[1], dtype=torch.long).index_add_(0, ranks, counts.long())


def shadow_loads(T: torch.Tensor, shadowed: Sequence[int]) -> torch.Tensor:
    """Long[ep]: rows each EP rank computes when `shadowed` experts are computed where their rows
    come from (T [ep, E] from `rows_per_rank`) and the others by their owners (Alg. 1 lines 6-9)."""
    ep_size, num_experts = T.shape
    owners = torch.arange(num_experts) // (num_experts // ep_size)
    local = torch.zeros(num_experts, dtype=torch.bool)
    local[list(shadowed)] = True
    load = T[:, local].sum(1)  # shadowed: computed at the source's rank
    return load.index_add_(0, owners[~local], T[:, ~local].sum(0))


def select_shadow_experts(T: torch.Tensor, cost: ShadowCostModel, min_shadow: int = 0) -> List[int]:
    """Alg. 1 on T [ep, E] (rows from each EP rank to each expert): the experts to shadow. Each
    candidate's loads come from the accepted set's: shadowing e moves its column from its owner
    to the sources' ranks (`shadow_loads`, O(ep) per candidate)."""
    ep_size, num_experts = T.shape
    rows = T.long().numpy()  # [ep, E]
    totals = rows.sum(0)  # [E]
    load = shadow_loads(T, []).numpy()
    c_min = cost.lat_imbl(float(load.max()))
    shadowed: List[int] = []
    for e in torch.argsort(T.sum(0), descending=True, stable=True).tolist():
        candidate = load + rows[:, e]
        candidate[e // (num_experts // ep_size)] -= totals[e]
        c = cost.lat_shadow(len(shadowed) + 1, float(candidate.max()))
        if c < c_min or len(shadowed) + 1 <= min_shadow:
            shadowed, load, c_min = shadowed + [e], candidate, c
        else:
            break
    return sorted(shadowed)


def fastmoe_release_shadow(T: torch.Tensor, cost: ShadowCostModel, min_shadow: int = 0) -> List[int]:
    """FastMoE's released policy (`moe.fastermoe.eq8: fastmoe`): experts by descending total rows
    B_(0) >= B_(1) >= ...; Lat = Eq. 7 at B_(0); shadowing the first i + 1 costs Eq. 7 at B_(i+1)
    (the next-largest expert's count) plus i + 1 parameter sends; accept while it drops."""
    totals = T.long().sum(0)
    order = torch.argsort(totals, descending=True, stable=True).tolist()
    c_min = cost.lat_imbl(float(totals[order[0]]))
    shadowed: List[int] = []
    for i, e in enumerate(order[:-1]):
        c = cost.lat_shadow(i + 1, float(totals[order[i + 1]]))
        if c < c_min or i + 1 <= min_shadow:
            shadowed, c_min = shadowed + [e], c
        else:
            break
    return sorted(shadowed)


def check_fastermoe_config(cfg) -> None:
    """`moe.fastermoe.eq8` (called by this technique's section check)."""
    from megatron_moe.config.errors import ConfigError
    from megatron_moe.techniques.fastermoe.fastermoe_model import EQ8

    if cfg.moe.fastermoe.eq8 not in EQ8:
        raise ConfigError(f"moe.fastermoe.eq8={cfg.moe.fastermoe.eq8!r} must be one of {', '.join(EQ8)}")


@BALANCERS.register("fastermoe")
class FasterMoE(Balancer):
    """Dynamic shadowing: Alg. 1 per forward with Eq. 7-8 fed by the hardware profile."""

    late_expert_grads = REPLICA_AGG

    def __init__(self, cfg, state):
        super().__init__(cfg, state)
        m, shape = cfg.model, expert_shape(cfg, state)
        self.cost = ShadowCostModel.from_profile(configured_profile(cfg, BALANCER_OPS, "moe.balancer=fastermoe"),
                                                 flops_per_row=shape.flops_per_row,
                                                 params_per_expert=float(shape.params(expert_proj_bias(cfg), state.esp_size)),
                                                 hidden=m.hidden_size,
                                                 eq8=cfg.moe.fastermoe.eq8)
        self.min_shadow = cfg.moe.fastermoe.min_shadow

    def plan(self, counts: torch.Tensor, source_ep_ranks: List[int]) -> Placement:
        T = rows_per_rank(counts, source_ep_ranks, self.ep_size)
        select = fastmoe_release_shadow if self.cost.eq8 == "fastmoe" else select_shadow_experts
        shadowed = select(T, self.cost, self.min_shadow) if self.ep_size > 1 else []
        return Placement.shadowed(counts, self.ep_size, shadowed, source_ep_ranks)


@section_check("moe.fastermoe")
def _check_fastermoe(cfg, world_size: int) -> None:
    moe = cfg.moe
    if moe.balancer == "fastermoe":
        check_fastermoe_config(cfg)
    if not 0 <= moe.fastermoe.min_shadow <= moe.num_experts:
        raise ConfigError(f"moe.fastermoe.min_shadow={moe.fastermoe.min_shadow} must be in [0, moe.num_experts]")


@SIDE_CHANNELS.register("fastermoe")
def _side_channels(cfg) -> list:
    """Trans / Agg of the shadowed experts travel on a side channel of ``ep`` (moe/replicas.py): on
    NCCL, ops on one communicator run one after another on its stream, so on ``ep`` itself Trans
    would hold the dispatch all-to-all back and Agg the backward all-to-alls of earlier layers."""
    return ["ep"] if cfg.moe.balancer == "fastermoe" else []


@PROFILE_NEEDS.register("fastermoe")
def _profile_needs(cfg) -> list:
    return [(BALANCER_OPS, "moe.balancer=fastermoe")] if cfg.moe.balancer == "fastermoe" else []
