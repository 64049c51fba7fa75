"""Top-k router (DESIGN.md §4): gate, top-k, capacity drops, load-balancing and z losses.

* Gate: logits = x W_r^T (+ b_r with `moe.router_bias`, gpt-oss) with W_r [E, h] and b_r [E]
  dense parameters replicated across TP; logits, scores and losses run in fp32 even under bf16
  autocast.
* Scores (`moe.score_function`): softmax over the experts (default), or sigmoid of each logit
  (DeepSeek-V3, Liu et al. 2024, Eq. 15).
* Selection: the k experts with the highest score; with `moe.expert_bias` (expert_bias.py) the
  highest score + bias (DeepSeek-V3 Eq. 16: the bias steers selection only); with group-limited
  routing (`moe.router_groups` G, `moe.router_group_topk` M; DeepSeek-V3 §2.1.2 node-limited
  routing) only among the experts of each token's M best groups, the E / G contiguous experts of a
  group scored by the sum of its two highest (selection) scores (DeepSeek-V3's rule; Megatron uses
  the top k / M), the other experts masked to -inf.
* Combine weights: the chosen (unbiased) scores; `moe.norm_topk_prob` (null = when k > 1)
  divides them by their sum: k=1 without it is Switch (Fedus et al. 2021), the weight is the top-1
  probability; k>1 with it is GShard (Lepikhin et al. 2020) / Mixtral; Qwen2-MoE and OLMoE keep the
  raw probabilities. gpt-oss's router (a softmax over the k selected logits) is softmax +
  norm_topk_prob: softmax(z_S)_i = exp(z_i) / sum_S exp(z_j) = p_i / sum_S p_j for the selected
  set S, and the top-k of the logits is the top-k of p (tests/unit/test_gpt_oss.py checks it
  against transformers' `GptOssTopKRouter`). Then x `moe.topk_scaling_factor`. Weights are fixed
  before capacity drops, so a dropped assignment keeps its share of the weight and contributes
  nothing (its token only passes through the residual connection).
* Capacity (`moe.capacity_factor` = f, null = dropless): C = ceil(f * n * k / E) assignments per
  expert for a data-parallel micro-batch of n tokens. Drops are by position, token-major: expert
  e keeps the first C tokens (in flattened [b*s] order) that chose it, whatever the choice's rank
  (first or second expert of its token). A token chooses an expert at most once, so its k choices
  never compete with each other, and a schedule that splits the micro-batch into contiguous pieces
  gets the same drops by passing each piece the per-expert counts of the pieces before it
  (`prior_counts`, as Lancet §5 passes counts between partitions; `GatePartition`).
* Aux loss (Switch Eq. 4 / GShard): E * sum_e f_e * P_e, f_e = assignments to e / (n k) before
  drops, P_e = mean router probability of e (sigmoid scores: each token's scores divided by their
  sum, DeepSeek-V3 Eq. 18); 1.0 when perfectly balanced.
* z-loss (ST-MoE, Zoph et al. 2022, Eq. 5): mean over tokens of logsumexp(logits)^2.
* Partitions (Lancet §5, `GatePartition`): a router whose `partition` is set routes one batch part
  of a micro-batch at a time with the whole micro-batch's capacity and positions, and leaves the
  aux loss to `GatePartition.aux_loss` once every part is routed (f_e needs every part's counts).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron_moe.config.errors import ConfigError
from megatron_moe.config.registry import Registry
from megatron_moe.config.schema import Config
from megatron_moe.config.validate import section_check
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.tensor_parallel.param_meta import ParamMeta, make_param
from megatron_moe.moe.expert_bias import LoadCounter, make_expert_bias


@dataclass
class Routing:
    """The router's decisions for n tokens."""

    expert_ids: torch.Tensor  # Long[n, k] chosen experts, by descending probability
    weights: torch.Tensor  # Float32[n, k] combine weights (differentiable)
    kept: torch.Tensor  # Bool[n, k] False where capacity dropped the assignment
    tokens_per_expert: torch.Tensor  # Long[E] assignments before drops
    aux_loss: torch.Tensor  # fp32 scalar: aux_loss_coeff * load balancing + z_loss_coeff * z-loss
    capacity: Optional[int] = None  # per expert, of the whole micro-batch (None = dropless)
    prior_counts: Optional[torch.Tensor] = None  # Long[E] assignments of the micro-batch's earlier parts

    @property
    def dropped(self) -> torch.Tensor:
        """Long scalar on the device (read with the iteration's statistics, not here: no host sync)."""
        return (~self.kept).sum()

    def dropped_of_counts(self) -> torch.Tensor:
        """Assignments of these tokens that capacity drops, from the counts alone (for a schedule
        whose `kept` covers only its own piece of the tokens, e.g. Parm S1's); a Long scalar on
        the device."""
        if self.capacity is None:
            return self.tokens_per_expert.new_zeros(())
        prior = self.prior_counts if self.prior_counts is not None else torch.zeros_like(self.tokens_per_expert)
        over = (prior + self.tokens_per_expert - self.capacity).clamp(min=0) - (prior - self.capacity).clamp(min=0)
        return over.sum()


def router_logits(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [n, h], W_r [E, h], b_r [E] or None -> fp32 logits [n, E], outside any autocast region."""
    with torch.autocast(device_type=x.device.type, enabled=False):
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


SCORE_FUNCTIONS = ("softmax", "sigmoid")


def group_limited(choice: torch.Tensor, groups: int, group_topk: int) -> torch.Tensor:
    """Selection scores [n, E] with the experts outside each token's `group_topk` best groups (of
    `groups` contiguous ones, scored by the sum of their two highest scores) set to -inf."""
    n, num_experts = choice.shape
    grouped = choice.view(n, groups, num_experts // groups)  # [n, G, E/G]
    group_scores = grouped.topk(min(2, num_experts // groups), dim=-1).values.sum(-1)  # [n, G]
    best = group_scores.topk(group_topk, dim=-1).indices  # [n, M]
    allowed = torch.zeros(n, groups, dtype=torch.bool, device=choice.device).scatter_(1, best, True)
    return grouped.masked_fill(~allowed[..., None], float("-inf")).view(n, num_experts)


def top_k_gating(logits: torch.Tensor, top_k: int, *, score_function: str = "softmax",
                 norm_topk_prob: Optional[bool] = None, scaling: float = 1.0,
                 selection_bias: Optional[torch.Tensor] = None, groups: int = 1,
                 group_topk: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 logits [n, E] -> (probs [n, E] for the aux loss, expert_ids [n, k], combine weights
    [n, k]) by the module docstring's rules."""
    scores = torch.softmax(logits, dim=-1) if score_function == "softmax" else torch.sigmoid(logits)
    choice = scores.detach() if selection_bias is None else scores.detach() + selection_bias
    if groups > 1:
        choice = group_limited(choice, groups, group_topk)
    expert_ids = torch.topk(choice, top_k, dim=-1).indices  # [n, k] by descending selection score
    weights = scores.gather(1, expert_ids)
    if top_k > 1 if norm_topk_prob is None else norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    if scaling != 1.0:
        weights = weights * scaling
    probs = scores if score_function == "softmax" else scores / scores.sum(-1, keepdim=True)
    return probs, expert_ids, weights


@section_check("moe.router")
def check_router_config(cfg: Config, world_size: int) -> None:
    """One-line errors for the score function, expert bias and group-limited routing keys."""
    moe = cfg.moe
    if moe.score_function not in SCORE_FUNCTIONS:
        raise ConfigError(f"moe.score_function={moe.score_function!r} must be one of {', '.join(SCORE_FUNCTIONS)}")
    if moe.topk_scaling_factor <= 0 or moe.expert_bias_rate < 0:
        raise ConfigError(f"moe.topk_scaling_factor={moe.topk_scaling_factor} must be > 0 and "
                          f"moe.expert_bias_rate={moe.expert_bias_rate} >= 0")
    if moe.router_groups < 1 or moe.num_experts % moe.router_groups:
        raise ConfigError(f"moe.router_groups={moe.router_groups} must be >= 1 and divide moe.num_experts={moe.num_experts}")
    variant = {"moe.score_function": moe.score_function != "softmax", "moe.expert_bias": moe.expert_bias,
               "moe.router_groups": moe.router_groups > 1, "moe.norm_topk_prob": moe.norm_topk_prob is not None,
               "moe.topk_scaling_factor": moe.topk_scaling_factor != 1.0}
    if moe.gate != "softmax" and any(variant.values()):
        key = next(k for k, on in variant.items() if on)
        raise ConfigError(f"{key}={getattr(moe, key.split('.')[1])} needs moe.gate=softmax "
                          f"(the {moe.gate} gate makes its own choices)")
    topk = moe.router_group_topk
    if moe.router_groups == 1:
        if topk is not None:
            raise ConfigError(f"moe.router_group_topk={topk} needs moe.router_groups > 1")
        return
    if topk is None or not 1 <= topk <= moe.router_groups:
        raise ConfigError(f"moe.router_group_topk={topk} must be in 1..moe.router_groups={moe.router_groups} "
                          "with group-limited routing")
    if topk * (moe.num_experts // moe.router_groups) < moe.top_k:
        raise ConfigError(f"moe.router_group_topk={topk} groups of {moe.num_experts // moe.router_groups} experts "
                          f"hold fewer than moe.top_k={moe.top_k}")


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: Optional[float]) -> Optional[int]:
    """Assignments each expert may take from one data-parallel micro-batch; None = dropless."""
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def expert_counts(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Long[E]: how many entries of `expert_ids` (any shape, values in [0, E)) name each expert.
    A scatter-add into [E], not `torch.bincount` (which reads the ids' maximum on the host)."""
    flat = expert_ids.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def kept_counts(expert_ids: torch.Tensor, kept: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Long[E]: the kept assignments (`kept` Bool, same shape as `expert_ids`) to each expert; the
    dropped ones go to an extra bin that is cut off (no boolean indexing: no host read)."""
    return expert_counts(expert_ids.masked_fill(~kept, num_experts), num_experts + 1)[:num_experts]


def capacity_keep(expert_ids: torch.Tensor, num_experts: int, capacity: Optional[int],
                  prior_counts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Bool[n, k]: assignment kept under `capacity` by token-major position (module docstring).
    `prior_counts` Long[E]: assignments to each expert in the pieces of the micro-batch before
    these n tokens.

    The position of an assignment among its expert's is its index in a stable sort of the
    flattened [n k] ids by expert minus the expert's first index there: token order within an
    expert, as a token chooses an expert at most once. O(n k) memory, nothing of size E per token
    (a one-hot [n, k, E] would be 512 MiB at 32k tokens and 256 experts)."""
    if capacity is None:
        return torch.ones_like(expert_ids, dtype=torch.bool)
    flat = expert_ids.reshape(-1)  # [n k] token-major
    order = torch.argsort(flat, stable=True)  # by expert, token order within an expert
    counts = expert_counts(flat, num_experts)
    starts = counts.cumsum(0) - counts  # [E] first index of each expert in `order`
    ranked = torch.arange(flat.numel(), device=flat.device) - starts.index_select(0, flat.index_select(0, order))
    position = torch.empty_like(flat).scatter_(0, order, ranked)  # [n k] earlier assignments to the same expert
    if prior_counts is not None:
        position = position + prior_counts.index_select(0, flat)
    return (position < capacity).view_as(expert_ids)


def load_balancing_loss(probs: torch.Tensor, tokens_per_expert: torch.Tensor, top_k: int) -> torch.Tensor:
    """E * sum_e f_e * P_e over n tokens (probs [n, E], counts before drops)."""
    n, num_experts = probs.shape
    fraction = tokens_per_expert.float() / (n * top_k)  # f_e, sums to 1
    return num_experts * (fraction * probs.mean(0)).sum()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """mean_t logsumexp(logits_t)^2 (fp32 logits [n, E])."""
    return torch.logsumexp(logits, dim=-1).pow(2).mean()


class GatePartition:
    """Lancet §5's capacity-preserving gating: one micro-batch of `total_tokens` tokens routed as
    contiguous batch parts, in order. Each part gets the capacity of the whole micro-batch and the
    per-expert counts of the parts before it (`prior_counts`), so drops are those of the
    unpartitioned batch; every part's router-probability and logsumexp^2 sums are kept so that
    `aux_loss` equals the unpartitioned aux loss (f_e needs the counts of every part)."""

    def __init__(self, total_tokens: int):
        self.total_tokens = total_tokens
        self.counts: Optional[torch.Tensor] = None  # Long[E] assignments of the parts routed so far
        self.prob_sums: list = []  # per part: [E] sum over its tokens of the router probabilities
        self.z_sums: list = []  # per part: scalar sum over its tokens of logsumexp(logits)^2

    def next_part(self, tokens_per_expert: torch.Tensor, prob_sum: torch.Tensor, z_sum: torch.Tensor
                  ) -> torch.Tensor:
        """Record one part (counts before drops, differentiable sums) -> the counts before it."""
        prior = self.counts if self.counts is not None else torch.zeros_like(tokens_per_expert)
        self.counts = prior + tokens_per_expert
        self.prob_sums.append(prob_sum)
        self.z_sums.append(z_sum)
        return prior

    def aux_loss(self, router: "Router") -> torch.Tensor:
        """The whole micro-batch's aux loss (router.py's formulas over every part)."""
        n = self.total_tokens
        return losses_from_sums(router, torch.stack(self.prob_sums).sum(0) / n, torch.stack(self.z_sums).sum() / n,
                                self.counts, n)


def losses_from_sums(router: "Router", mean_probs: torch.Tensor, mean_z: torch.Tensor,
                     tokens_per_expert: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """aux_loss_coeff * E * sum_e f_e P_e + z_loss_coeff * z from P_e = `mean_probs` [E] and
    z = `mean_z`, the token means of a micro-batch of `num_tokens` routed in pieces."""
    fraction = tokens_per_expert.float() / (num_tokens * router.top_k)  # f_e
    return (router.aux_loss_coeff * router.num_experts * (fraction * mean_probs).sum()
            + router.z_loss_coeff * mean_z)


GATES = Registry("moe.gate")  # "softmax" here, "topology": techniques/fastermoe/topology_gate.py


@section_check("moe.gate")
def _check_gate(cfg: Config, world_size: int) -> None:
    GATES.get(cfg.moe.gate)


@GATES.register("softmax")
class Router(torch.nn.Module):
    """Routes one data-parallel micro-batch (or a schedule's piece of one) of tokens [n, h]."""

    def __init__(self, cfg: Config, state: ParallelState):
        super().__init__()
        moe = cfg.moe
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.capacity_factor = moe.capacity_factor
        self.aux_loss_coeff, self.z_loss_coeff = moe.aux_loss_coeff, moe.z_loss_coeff
        self.weight = make_param(ParamMeta("dense", (moe.num_experts, cfg.model.hidden_size),
                                           std=cfg.model.init_std, role="weight"), state)  # W_r [E, h], replicated
        # moe.router_bias: b_r [E], replicated (zeros; transformers draws gpt-oss's from N(0, init_std))
        self.bias = (make_param(ParamMeta("dense", (moe.num_experts,), init="zeros", role="bias"), state)
                     if moe.router_bias else None)
        self.scoring = dict(score_function=moe.score_function, norm_topk_prob=moe.norm_topk_prob,
                            scaling=moe.topk_scaling_factor, groups=moe.router_groups, group_topk=moe.router_group_topk)
        # moe.expert_bias (expert_bias.py): frozen [E] selection bias and the loads since its last update
        self.expert_bias = make_expert_bias(moe.num_experts, state) if moe.expert_bias else None
        self.loads = LoadCounter()
        # measurement hook, no config key: a fixed fp32 [E] bias added to the logits so benchmarks can
        # create skewed routing (benchmarks/moe_layer.py --skew); None in training
        self.logit_bias: Optional[torch.Tensor] = None
        self.partition: Optional[GatePartition] = None  # set while Lancet's partitioned forward routes parts

    def logits(self, x: torch.Tensor, mapped: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
        """fp32 logits [n, E] of tokens x [n, h] (`mapped`: applied to W_r and b_r first, e.g. S1's
        copy into the TP region)."""
        weight, bias = ((p if mapped is None or p is None else mapped(p)) for p in (self.weight, self.bias))
        logits = router_logits(x, weight, bias)
        return logits if self.logit_bias is None else logits + self.logit_bias.to(logits.device)

    def select(self, logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp32 logits [n, E] -> (probs [n, E], expert_ids [n, k], combine weights [n, k]): the
        gate's choice (top-k by the module docstring; `moe.gate` registers others)."""
        return top_k_gating(logits, self.top_k, selection_bias=self.expert_bias, **self.scoring)

    def capacity(self, num_tokens: int) -> Optional[int]:
        """Per-expert capacity for `num_tokens` tokens (those of the whole micro-batch when routing a part)."""
        total = self.partition.total_tokens if self.partition is not None else num_tokens
        return expert_capacity(total, self.num_experts, self.top_k, self.capacity_factor)

    def forward(self, x: torch.Tensor) -> Routing:
        logits = self.logits(x)  # [n, E] fp32
        probs, expert_ids, weights = self.select(logits)
        tokens_per_expert = expert_counts(expert_ids, self.num_experts)  # [E]
        capacity = self.capacity(x.shape[0])
        if self.partition is not None:  # one part: losses once every part is routed
            prior = self.partition.next_part(tokens_per_expert, probs.sum(0), torch.logsumexp(logits, -1).pow(2).sum())
            kept = capacity_keep(expert_ids, self.num_experts, capacity, prior_counts=prior)
            return Routing(expert_ids, weights, kept, tokens_per_expert, logits.new_zeros(()), capacity, prior)
        kept = capacity_keep(expert_ids, self.num_experts, capacity)
        aux_loss = (self.aux_loss_coeff * load_balancing_loss(probs, tokens_per_expert, self.top_k)
                    + self.z_loss_coeff * z_loss(logits))
        return Routing(expert_ids, weights, kept, tokens_per_expert, aux_loss, capacity)

