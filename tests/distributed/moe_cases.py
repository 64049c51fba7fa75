"""Shared cases and checks of the MoE-layer exactness tests (every schedule against `tests/moe_reference.py`).

A worker runs `run_layer` for each case on its rank: every data-parallel rank d has its own tokens
xs[d] and upstream gradient gs[d] (identical on d's TP ranks) and back-propagates
sum(y * gs[d]) + aux. `check_against_reference` then compares, for every rank, the output, aux
loss, input gradient and routing statistics with the reference of micro-batch d, and every
parameter gradient after emulating the trainer (SUM over `edp` for expert params / over `dp` for
dense ones, divided by dp_size) with the reference gradient of the mean loss over all
data-parallel micro-batches, sliced to the rank's shard. The layer runs on the worker's device
(`harness.device()`: its GPU under NCCL).
"""
from typing import Dict, List

import torch

from megatron_moe.config.schema import Config
from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.parallel_state import ParallelState, RankLayout
from megatron_moe.techniques.lancet import lancet
from megatron_moe.moe.layer import MoELayer
from tests.distributed.harness import device
from tests.moe_reference import load_full_weights_, random_full_weights, reference_moe

B, S, H, FFN, E = 2, 4, 8, 8, 4  # micro-batch, sequence, hidden, expert FFN, experts
FP32 = dict(rtol=1e-5, atol=1e-6)
CASES = [  # (capacity_factor, top_k, activation, bias)
    (None, 2, "gelu", True),
    (1.0, 2, "swiglu", True),
    (1.0, 1, "gelu", False),
    (None, 1, "swiglu", False),
    (1.0, 1, "swiglu", False),  # + VARIANTS[4]
    (1.0, 2, "gelu", True),  # + VARIANTS[5]
    (1.0, 2, "swiglu", False),  # + VARIANTS[6]
]
VARIANTS = {  # moe.* keys of a case beyond the plain softmax router
    # DeepSeek-V3-like: sigmoid scores, expert bias, group-limited (2 groups of 2, the best one), scaled, shared expert
    4: dict(score_function="sigmoid", expert_bias=True, router_groups=2, router_group_topk=1, norm_topk_prob=False,
            topk_scaling_factor=2.5, shared_expert_ffn_hidden_size=8),
    # Qwen2-MoE-like: raw top-k probabilities, a gated shared expert
    5: dict(norm_topk_prob=False, shared_expert_ffn_hidden_size=8, shared_expert_gate=True),
    # gpt-oss-like: router bias, expert biases without model.bias, clamped SwiGLU (a limit that clamps)
    6: dict(router_bias=True, expert_proj_bias=True, activation="swiglu_oss", swiglu_limit=0.8),
}


def case_config(index: int) -> Config:
    capacity_factor, top_k, activation, bias = CASES[index]
    cfg = Config()
    cfg.model.hidden_size, cfg.model.activation, cfg.model.bias = H, activation, bias
    cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.capacity_factor = E, top_k, capacity_factor
    cfg.moe.expert_ffn_hidden_size, cfg.moe.aux_loss_coeff, cfg.moe.z_loss_coeff = FFN, 0.1, 0.01
    for key, value in VARIANTS.get(index, {}).items():
        setattr(cfg.moe, key, value)
    return cfg


def case_data(index: int, dp: int):
    """Config, full weights, and per data-parallel rank tokens xs[d] and upstream gradients gs[d]
    [B, S, H]. Expert 0 is favoured (router column 0 and feature 0 shifted) so capacity drops."""
    cfg = case_config(index)
    full = random_full_weights(cfg, seed=index)
    full["router.weight"][0, 0] += 2.0
    gen = torch.Generator().manual_seed(100 + index)
    xs = torch.randn(dp, B, S, H, generator=gen)
    xs[..., 0] += 1.0
    return cfg, full, xs, torch.randn(dp, B, S, H, generator=gen)


def run_layer(state, cfg: Config, full, xs, gs, balancer=None) -> Dict:
    """This rank's forward + backward of one MoE layer (cfg may name any schedule and balancer;
    `balancer`, a Balancer instance, replaces the configured one)."""
    d = state.layout.coords(state.rank)["dp"]
    layer = MoELayer(cfg, state, layer_index=0)
    if balancer is not None:
        layer.balancer = balancer
    lancet.attach_from_config(layer, cfg)  # moe.lancet.defer_wgrad
    load_full_weights_(layer, full, state)
    layer.to(device())
    x = xs[d].clone().to(device()).requires_grad_(True)
    y, aux = layer(x)
    ((y * gs[d].to(device())).sum() + aux).backward()
    params = {n: p for n, p in layer.named_parameters() if p.requires_grad}  # not the expert bias
    return dict(y=y.detach(), aux=aux.detach(), dx=x.grad, stats=layer.last_stats,
                grads={n: p.grad for n, p in params.items()},
                meta={n: (p.meta.kind, p.meta.local_slices(state)) for n, p in params.items()})


def run_on_layouts(state, jobs, runs, setup, side_channels=()) -> List[List]:
    """For every layout (kwargs) in `jobs` and every item of `runs`, on this spawn's processes:
    (run_layer's result, with "calls" per kind/group added, bytes by kind/group). `setup(run)` ->
    (case index, edit) where `edit(cfg, sub_state)` sets the schedule/balancer keys and returns a
    Balancer instance (or None: the configured one). `side_channels`: as `ParallelState.build`'s."""
    out = []
    for kwargs in jobs:
        sub = ParallelState.build(RankLayout(world_size=state.world_size, **kwargs), state.rank, side_channels)
        results = []
        for run in runs:
            index, edit = setup(run)
            cfg, full, xs, gs = case_data(index, sub.dp_size)
            balancer = edit(cfg, sub)
            C.COMM_STATS.reset()
            result = run_layer(sub, cfg, full, xs, gs, balancer=balancer)
            result["calls"] = dict(C.COMM_STATS.calls)
            results.append((result, C.COMM_STATS.snapshot()))
        out.append(results)
    return out


def reference(index: int, dp: int):
    """Per micro-batch reference outputs, dL_d/dx_d, and weight gradients of mean_d L_d."""
    return reference_of(*case_data(index, dp))


def reference_of(cfg: Config, full, xs, gs, remote=None, budget: int = 0):
    """`reference` for any weights and per-micro-batch tokens xs / upstream gradients gs [dp, B, S, H];
    with `remote` (per micro-batch, Bool per expert) the topology-aware gate's routing under `budget`."""
    dp = xs.shape[0]
    weights = {n: t.clone().requires_grad_(True) for n, t in full.items()}
    xs = [xs[d].reshape(B * S, H).clone().requires_grad_(True) for d in range(dp)]
    refs = [reference_moe(x, weights, cfg, remote[d] if remote else None, budget) for d, x in enumerate(xs)]
    loss = sum((ref.y * gs[d].reshape(B * S, H)).sum() + ref.aux_loss for d, ref in enumerate(refs)) / dp
    loss.backward()
    return refs, [x.grad * dp for x in xs], {n: w.grad for n, w in weights.items()}


def check_against_reference(results: List[Dict], index: int, layout: RankLayout, label: str = "") -> list:
    """results[rank] = `run_layer`'s dict for case `index`. Returns the per-micro-batch references."""
    refs = check_results(results, reference(index, layout.data_parallel), layout, f"{label} case {index}")
    if CASES[index][0] is not None:
        assert sum(ref.dropped for ref in refs) > 0, "capacity case dropped nothing"
    return refs


def check_results(results: List[Dict], reference_output, layout: RankLayout, label: str = "") -> list:
    """Every rank's `run_layer` dict against `reference_of(...)`'s output; returns the references."""
    refs, ref_dx, ref_grads = reference_output
    for rank, res in enumerate(results):
        d = layout.coords(rank)["dp"]
        where = f"{label} rank {rank}"
        torch.testing.assert_close(res["y"].reshape(B * S, H), refs[d].y.detach(), **FP32,
                                   msg=lambda m: f"{where} y: {m}")
        torch.testing.assert_close(res["aux"], refs[d].aux_loss.detach(), **FP32, msg=lambda m: f"{where} aux: {m}")
        torch.testing.assert_close(res["dx"].reshape(B * S, H), ref_dx[d], **FP32, msg=lambda m: f"{where} dx: {m}")
        assert res["stats"].tokens_per_expert.tolist() == refs[d].tokens_per_expert, where
        assert res["stats"].dropped == refs[d].dropped, where
        for name, (kind, slices) in res["meta"].items():
            replicas = layout.group_of("edp" if kind == "expert" else "dp", rank)
            synced = sum(results[q]["grads"][name] for q in replicas) / layout.data_parallel
            torch.testing.assert_close(synced, ref_grads[name][slices], **FP32, msg=lambda m: f"{where} {name}: {m}")
    return refs


def patterned_tokens(pattern: str) -> torch.Tensor:
    """[B, S, H] tokens whose routing under router weight `ROUTER_EYE` (dropless, k = 2) is fixed:
    "balanced": token t chooses experts t mod E and t+1 mod E (every expert 2 B S / E, also in each
    contiguous quarter of the tokens); "skewed": every token chooses experts 0 and 1."""
    t = torch.arange(B * S)
    first = t % E if pattern == "balanced" else torch.zeros_like(t)
    x = torch.zeros(B * S, H)
    x[t, first], x[t, (first + 1) % E] = 2.0, 1.0
    return x.view(B, S, H)


ROUTER_EYE = 10.0 * torch.eye(E, H)


def balanced_layer_comm(state, cfg: Config):
    """Bytes of one forward and one backward with deterministic, perfectly balanced routing
    (dropless, k = 2): router = 10 * I, token t = 2 e_(t mod E) + e_(t+1 mod E), so token t chooses
    experts t mod E and t+1 mod E and every expert gets 2 B S / E of each rank's tokens (also of
    each contiguous quarter of them)."""
    assert cfg.moe.top_k == 2 and cfg.moe.capacity_factor is None
    full = random_full_weights(cfg, seed=7)
    full["router.weight"] = ROUTER_EYE.clone()
    layer = MoELayer(cfg, state, layer_index=0)
    load_full_weights_(layer, full, state)
    layer.to(device())
    x = patterned_tokens("balanced").to(device()).requires_grad_(True)
    C.COMM_STATS.reset()
    y, aux = layer(x)
    forward = C.COMM_STATS.snapshot()
    C.COMM_STATS.reset()
    ((y * y.detach()).sum() + aux).backward()
    return forward, C.COMM_STATS.snapshot()
