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
  and b1[e] [2, f] hold the gate ([:, 0]) and up ([:, 1]) projections: silu(gate) * up; swiglu_oss
  (gpt-oss, `moe.activation`): (clamp(up, -L, L) + 1) * g sigmoid(1.702 g), g = min(gate, L).
  `moe.router_bias`: p_t = softmax(W_r x_t + b_r); biases b1 / b2 iff `moe.expert_proj_bias` (null = model.bias).
  aux = aux_coeff * E * sum_e (#choices of e / (n k)) * mean_t p_t,e + z_coeff * mean_t logsumexp(W_r x_t)^2.
Variants (router.py, shared_expert.py): sigmoid scores s_t,e = sigmoid(W_r x_t)_e (p_t = s_t / sum_e s_t,e
for the aux loss); choices by s + expert bias (weights from s); group-limited: only experts of the
`router_group_topk` groups with the largest sums of their two best (s + bias) (ties: lower group);
weights divided by their sum iff norm_topk_prob (default k > 1), times topk_scaling_factor; a shared
expert adds sigmoid(w_g x_t) * fc2(act(fc1 x_t)) to every token.
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
    kept: List[List[int]]  # per token: its kept choices (experts), in choice order


def _gelu(v: torch.Tensor) -> torch.Tensor:
    return 0.5 * v * (1.0 + torch.erf(v / math.sqrt(2.0)))


def _expert(v: torch.Tensor, e: int, weights: Dict[str, torch.Tensor], activation: str, limit: float = 7.0
            ) -> torch.Tensor:
    bias = weights["experts.b1"][e] if "experts.b1" in weights else torch.zeros_like(weights["experts.w1"][e][0])
    if activation in ("swiglu", "swiglu_oss"):
        gate = v @ weights["experts.w1"][e][:, 0] + bias[0]
        up = v @ weights["experts.w1"][e][:, 1] + bias[1]
        if activation == "swiglu":
            hidden = gate * torch.sigmoid(gate) * up
        else:
            gate, up = torch.clamp(gate, max=limit), torch.clamp(up, -limit, limit)
            hidden = (up + 1) * gate * torch.sigmoid(1.702 * gate)
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


def _choices(score: torch.Tensor, bias, moe, k: int) -> List[int]:
    """Token's k experts by descending selection score (+ bias), group-limited if configured."""
    choice = [float(score[e]) + (float(bias[e]) if bias is not None else 0.0) for e in range(len(score))]
    allowed = range(len(score))
    if moe.router_groups > 1:
        size = len(score) // moe.router_groups
        group_score = [sum(sorted(choice[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(moe.router_groups)]
        best = sorted(range(moe.router_groups), key=lambda g: -group_score[g])[:moe.router_group_topk]
        allowed = [e for e in allowed if e // size in best]
    return sorted(allowed, key=lambda e: -choice[e])[:k]


def _shared(v: torch.Tensor, weights: Dict[str, torch.Tensor], activation: str) -> torch.Tensor:
    """The shared expert on one token: (gate) * fc2(act(fc1 v))."""
    w1, b1 = weights["shared_expert.mlp.fc1.weight"], weights.get("shared_expert.mlp.fc1.bias")
    if activation == "swiglu":  # fc1 [2, f, h]: (gate, up)
        gate, up = (w1[j] @ v + (b1[j] if b1 is not None else 0) for j in range(2))
        hidden = gate * torch.sigmoid(gate) * up
    else:
        hidden = _gelu(w1 @ v + (b1 if b1 is not None else 0))
    out = weights["shared_expert.mlp.fc2.weight"] @ hidden
    if "shared_expert.mlp.fc2.bias" in weights:
        out = out + weights["shared_expert.mlp.fc2.bias"]
    if "shared_expert.gate" in weights:
        out = torch.sigmoid(weights["shared_expert.gate"][0] @ v) * out
    return out


def reference_moe(x: torch.Tensor, weights: Dict[str, torch.Tensor], cfg: Config,
                  remote: Optional[List[bool]] = None, budget: int = 0) -> ReferenceOutput:
    """x [n, h] (one data-parallel micro-batch, tokens flattened in [b*s] order). With `remote`
    (Bool per expert), the topology-aware gate's choices under `budget` replace the top-k."""
    moe = cfg.moe
    n, num_experts, k = x.shape[0], moe.num_experts, moe.top_k
    router = weights["router.weight"]
    logits = [router @ x[t] + weights.get("router.bias", 0.0) for t in range(n)]
    sigmoid = moe.score_function == "sigmoid"
    scores = [torch.sigmoid(logit) if sigmoid else torch.softmax(logit, dim=0) for logit in logits]
    probs = [score / score.sum() for score in scores] if sigmoid else scores  # for the aux loss
    bias = weights.get("router.expert_bias")
    norm = k > 1 if moe.norm_topk_prob is None else moe.norm_topk_prob
    capacity = None if moe.capacity_factor is None else math.ceil(moe.capacity_factor * n * k / num_experts)
    chosen_count, kept_count = [0] * num_experts, [0] * num_experts
    outputs, kept = [], []
    gated = topology_choices([p.detach() for p in probs], k, remote, budget) if remote is not None else None
    for t in range(n):
        choices = gated[t] if gated else _choices(scores[t].detach(), None if bias is None else bias.detach(), moe, k)
        total = sum(scores[t][e] for e in choices)
        out = torch.zeros_like(x[t])
        kept.append([])
        for e in choices:
            chosen_count[e] += 1
            if capacity is not None and chosen_count[e] > capacity:
                continue
            kept_count[e] += 1
            kept[-1].append(e)
            weight = (scores[t][e] / total if norm else scores[t][e]) * moe.topk_scaling_factor
            out = out + weight * _expert(x[t], e, weights, moe.activation or cfg.model.activation, moe.swiglu_limit)
        if "shared_expert.mlp.fc1.weight" in weights:
            out = out + _shared(x[t], weights, cfg.model.activation)
        outputs.append(out)
    mean_prob = torch.stack(probs).mean(0)
    balance = num_experts * sum(chosen_count[e] / (n * k) * mean_prob[e] for e in range(num_experts))
    z = torch.stack([torch.logsumexp(logit, dim=0) ** 2 for logit in logits]).mean()
    aux = moe.aux_loss_coeff * balance + moe.z_loss_coeff * z
    return ReferenceOutput(torch.stack(outputs), aux, chosen_count, kept_count, sum(chosen_count) - sum(kept_count),
                           kept)


def random_full_weights(cfg: Config, seed: int, router_std: float = 1.0, bias_std: float = 0.5) -> Dict[str, torch.Tensor]:
    """Full (unsharded) MoE layer weights with O(1) activations, keyed like MoELayer.named_parameters()."""
    m, num_experts = cfg.model, cfg.moe.num_experts
    ffn = cfg.moe.expert_ffn_hidden_size or m.ffn_hidden_size
    units = (2, ffn) if (cfg.moe.activation or m.activation) in ("swiglu", "swiglu_oss") else (ffn,)
    gen = torch.Generator().manual_seed(seed)
    full = {
        "router.weight": torch.randn(num_experts, m.hidden_size, generator=gen) * router_std,
        "experts.w1": torch.randn(num_experts, m.hidden_size, *units, generator=gen) / math.sqrt(m.hidden_size),
        "experts.w2": torch.randn(num_experts, ffn, m.hidden_size, generator=gen) / math.sqrt(ffn),
    }
    if cfg.moe.router_bias:
        full["router.bias"] = torch.randn(num_experts, generator=gen) * bias_std
    if m.bias if cfg.moe.expert_proj_bias is None else cfg.moe.expert_proj_bias:
        full["experts.b1"] = torch.randn(num_experts, *units, generator=gen) * bias_std
        full["experts.b2"] = torch.randn(num_experts, m.hidden_size, generator=gen) * bias_std
    moe = cfg.moe
    if moe.expert_bias:  # as if after some updates: it changes choices
        full["router.expert_bias"] = torch.randn(num_experts, generator=gen) * 0.3
    if moe.shared_expert_ffn_hidden_size:
        f = moe.shared_expert_ffn_hidden_size
        gates = (2,) if m.activation == "swiglu" else ()  # the shared expert's: model.activation
        full["shared_expert.mlp.fc1.weight"] = torch.randn(*gates, f, m.hidden_size, generator=gen) / math.sqrt(m.hidden_size)
        full["shared_expert.mlp.fc2.weight"] = torch.randn(m.hidden_size, f, generator=gen) / math.sqrt(f)
        if m.bias:
            full["shared_expert.mlp.fc1.bias"] = torch.randn(*gates, f, generator=gen) * bias_std
            full["shared_expert.mlp.fc2.bias"] = torch.randn(m.hidden_size, generator=gen) * bias_std
        if moe.shared_expert_gate:
            full["shared_expert.gate"] = torch.randn(1, m.hidden_size, generator=gen)
    return full


@torch.no_grad()
def load_full_weights_(module: torch.nn.Module, full: Dict[str, torch.Tensor], state) -> None:
    """Copy this rank's shard of every full tensor into `module`'s parameters (by name)."""
    for name, p in module.named_parameters():
        p.copy_(full[name][p.meta.local_slices(state)])
