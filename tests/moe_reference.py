"""THE single-process reference MoE layer that every schedule and balancer test compares against
(DESIGN.md §5). Plain loops over tokens and experts, written from the math alone; it shares no
code with `megatron_moe.moe`.

    full = random_full_weights(cfg, seed)       # {MoELayer parameter name: full tensor}
    load_full_weights_(layer, full, state)      # each rank copies its shard into the layer
    ref = reference_moe(x, full, cfg)           # y, aux loss, routing statistics
    # ref.y / ref.aux_loss are differentiable w.r.t. x and the full weights (use autograd for grads)

Math (one data-parallel micro-batch of n tokens, E experts, top-k):
  p_t = softmax(W_r x_t); the k largest p_t,e (ties: lower expert index) are token t's choices,
  weighted by p_t,e (k = 1) or p_t,e / sum of the k chosen (k > 1).
  Capacity C = ceil(f n k / E): walking tokens in order, expert e accepts a choice while it has
  accepted fewer than C (a choice's rank among the token's k does not matter).
  y_t = sum over accepted choices of weight * expert_e(x_t);
  expert_e(v) = act(v w1[e] + b1[e]) w2[e] + b2[e], act = exact GeLU; for SwiGLU w1[e] [h, 2, f]
  and b1[e] [2, f] hold the gate ([:, 0]) and up ([:, 1]) projections: silu(gate) * up.
  aux = aux_coeff * E * sum_e (#choices of e / (n k)) * mean_t p_t,e + z_coeff * mean_t logsumexp(W_r x_t)^2.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from megatron_moe.config.schema import Config


@dataclass
class ReferenceOutput:
    y: torch.Tensor  # [n, h]
    aux_loss: torch.Tensor  # scalar
    tokens_per_expert: List[int]  # choices per expert before drops
    kept_per_expert: List[int]  # choices per expert after drops
    dropped: int


def _gelu(v: torch.Tensor) -> torch.Tensor:
    return 0.5 * v * (1.0 + torch.erf(v / math.sqrt(2.0)))


def _expert(v: torch.Tensor, e: int, weights: Dict[str, torch.Tensor], activation: str) -> torch.Tensor:
    bias = weights["experts.b1"][e] if "experts.b1" in weights else torch.zeros_like(weights["experts.w1"][e][0])
    if activation == "swiglu":
        gate = v @ weights["experts.w1"][e][:, 0] + bias[0]
        up = v @ weights["experts.w1"][e][:, 1] + bias[1]
        hidden = gate * torch.sigmoid(gate) * up
    else:
        hidden = _gelu(v @ weights["experts.w1"][e] + bias)
    out = hidden @ weights["experts.w2"][e]
    if "experts.b2" in weights:
        out = out + weights["experts.b2"][e]
    return out


def topology_choices(probs: List[torch.Tensor], k: int, remote: List[bool], budget: int) -> List[List[int]]:
    """FasterMoE's topology-aware gate (§4.3) by plain loops: every token's best k experts; if more
    than `budget` of those (token, expert) pairs are remote, the `budget` with the highest
    probability stay (ties: earlier token, then earlier choice) and each other one is replaced by
    the token's best local expert not chosen yet (none left: it stays)."""
    n, num_experts = len(probs), len(remote)
    best = [sorted(range(num_experts), key=lambda e: -float(probs[t][e]))[:k] for t in range(n)]
    pairs = [(float(probs[t][e]), t, i) for t in range(n) for i, e in enumerate(best[t]) if remote[e]]
    if len(pairs) <= budget:
        return best
    allowed = {(t, i) for _, t, i in sorted(pairs, key=lambda p: (-p[0], p[1], p[2]))[:budget]}
    out = []
    for t in range(n):
        final = [e for i, e in enumerate(best[t]) if not remote[e] or (t, i) in allowed]
        local = [e for e in sorted(range(num_experts), key=lambda e: -float(probs[t][e]))
                 if not remote[e] and e not in best[t]]
        for i, e in enumerate(best[t]):
            if remote[e] and (t, i) not in allowed:
                final.append(local.pop(0) if local else e)
        out.append(sorted(final, key=lambda e: -float(probs[t][e])))
    return out


def reference_moe(x: torch.Tensor, weights: Dict[str, torch.Tensor], cfg: Config,
                  remote: Optional[List[bool]] = None, budget: int = 0) -> ReferenceOutput:
    """x [n, h] (one data-parallel micro-batch, tokens flattened in [b*s] order). With `remote`
    (Bool per expert), the topology-aware gate's choices under `budget` replace the top-k."""
    moe = cfg.moe
    n, num_experts, k = x.shape[0], moe.num_experts, moe.top_k
    router = weights["router.weight"]
    logits = [router @ x[t] for t in range(n)]
    probs = [torch.softmax(logit, dim=0) for logit in logits]
    capacity = None if moe.capacity_factor is None else math.ceil(moe.capacity_factor * n * k / num_experts)
    chosen_count, kept_count = [0] * num_experts, [0] * num_experts
    outputs = []
    gated = topology_choices([p.detach() for p in probs], k, remote, budget) if remote is not None else None
    for t in range(n):
        choices = gated[t] if gated else sorted(range(num_experts), key=lambda e: -float(probs[t][e].detach()))[:k]
        total = sum(probs[t][e] for e in choices)
        out = torch.zeros_like(x[t])
        for e in choices:
            chosen_count[e] += 1
            if capacity is not None and chosen_count[e] > capacity:
                continue
            kept_count[e] += 1
            weight = probs[t][e] if k == 1 else probs[t][e] / total
            out = out + weight * _expert(x[t], e, weights, cfg.model.activation)
        outputs.append(out)
    mean_prob = torch.stack(probs).mean(0)
    balance = num_experts * sum(chosen_count[e] / (n * k) * mean_prob[e] for e in range(num_experts))
    z = torch.stack([torch.logsumexp(logit, dim=0) ** 2 for logit in logits]).mean()
    aux = moe.aux_loss_coeff * balance + moe.z_loss_coeff * z
    return ReferenceOutput(torch.stack(outputs), aux, chosen_count, kept_count, sum(chosen_count) - sum(kept_count))


def random_full_weights(cfg: Config, seed: int, router_std: float = 1.0, bias_std: float = 0.5) -> Dict[str, torch.Tensor]:
    """Full (unsharded) MoE layer weights with O(1) activations, keyed like MoELayer.named_parameters()."""
    m, num_experts = cfg.model, cfg.moe.num_experts
    ffn = cfg.moe.expert_ffn_hidden_size or m.ffn_hidden_size
    units = (2, ffn) if m.activation == "swiglu" else (ffn,)
    gen = torch.Generator().manual_seed(seed)
    full = {
        "router.weight": torch.randn(num_experts, m.hidden_size, generator=gen) * router_std,
        "experts.w1": torch.randn(num_experts, m.hidden_size, *units, generator=gen) / math.sqrt(m.hidden_size),
        "experts.w2": torch.randn(num_experts, ffn, m.hidden_size, generator=gen) / math.sqrt(ffn),
    }
    if m.bias:
        full["experts.b1"] = torch.randn(num_experts, *units, generator=gen) * bias_std
        full["experts.b2"] = torch.randn(num_experts, m.hidden_size, generator=gen) * bias_std
    return full


@torch.no_grad()
def load_full_weights_(module: torch.nn.Module, full: Dict[str, torch.Tensor], state) -> None:
    """Copy this rank's shard of every full tensor into `module`'s parameters (by name)."""
    for name, p in module.named_parameters():
        p.copy_(full[name][p.meta.local_slices(state)])
