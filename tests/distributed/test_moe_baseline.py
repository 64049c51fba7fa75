"""Baseline schedule (Parm Fig. 3(a)) == single-process reference, and Parm Eq. (1)'s volumes.

Each spawn runs every case of `CASES` on one layout: output, aux loss, input gradient and routing
statistics per rank, and every parameter gradient after emulating the trainer's rule (each rank
back-propagates its own micro-batch loss; SUM over `edp` for expert params / over `dp` for the
router, divided by dp_size) against the reference gradient of the mean loss over all
data-parallel micro-batches, sliced to the rank's shard. Every data-parallel rank has its own tokens.
"""

import pytest
import torch

from megatron_moe.config.schema import Config
from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.parallel_state import RankLayout
from megatron_moe.moe.layer import MoELayer
from tests.distributed.harness import run_distributed
from tests.moe_reference import load_full_weights_, random_full_weights, reference_moe

B, S, H, FFN, E = 2, 4, 8, 8, 4  # micro-batch, sequence, hidden, expert FFN, experts
FP32 = dict(rtol=1e-5, atol=1e-6)
CASES = [  # (capacity_factor, top_k, activation, bias)
    (None, 2, "gelu", True),
    (1.0, 2, "swiglu", True),
    (1.0, 1, "gelu", False),
    (None, 1, "swiglu", False),
]
LAYOUTS = [
    (2, dict(tensor=2)),
    (2, dict(expert=2)),
    (4, dict(expert=2)),  # + data parallel 2
    (8, dict(tensor=2, expert=2, expert_shard=2)),  # Parm Fig. 2: N_MP = N_EP = N_ESP = 2
    (8, dict(expert=4, expert_shard=2)),
]


def _cfg(case) -> Config:
    capacity_factor, top_k, activation, bias = case
    cfg = Config()
    cfg.model.hidden_size, cfg.model.activation, cfg.model.bias = H, activation, bias
    cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.capacity_factor = E, top_k, capacity_factor
    cfg.moe.expert_ffn_hidden_size, cfg.moe.aux_loss_coeff, cfg.moe.z_loss_coeff = FFN, 0.1, 0.01
    return cfg


def _case_data(index: int, dp: int):
    """Config, full weights, and per data-parallel rank tokens xs[d] and upstream gradients gs[d]
    [B, S, H]. Expert 0 is favoured (router column 0 and feature 0 shifted) so capacity drops."""
    cfg = _cfg(CASES[index])
    full = random_full_weights(cfg, seed=index)
    full["router.weight"][0, 0] += 2.0
    gen = torch.Generator().manual_seed(100 + index)
    xs = torch.randn(dp, B, S, H, generator=gen)
    xs[..., 0] += 1.0
    return cfg, full, xs, torch.randn(dp, B, S, H, generator=gen)


def _balanced_layer_comm(state):
    """Bytes of one forward and one backward with deterministic, perfectly balanced routing:
    router = 10 * I, token t = 2 e_(t mod E) + e_(t+1 mod E), so token t chooses experts t mod E
    and t+1 mod E (k = 2) and every expert gets 2 B S / E of each rank's tokens."""
    cfg = _cfg((None, 2, "gelu", False))
    full = random_full_weights(cfg, seed=7)
    full["router.weight"] = 10.0 * torch.eye(E, H)
    layer = MoELayer(cfg, state, layer_index=0)
    load_full_weights_(layer, full, state)
    t = torch.arange(B * S)
    x = torch.zeros(B * S, H)
    x[t, t % E], x[t, (t + 1) % E] = 2.0, 1.0
    x = x.view(B, S, H).requires_grad_(True)
    C.COMM_STATS.reset()
    y, aux = layer(x)
    forward = C.COMM_STATS.snapshot()
    C.COMM_STATS.reset()
    ((y * y.detach()).sum() + aux).backward()
    return forward, C.COMM_STATS.snapshot()


def _run_cases(state, check_comm):
    d = state.layout.coords(state.rank)["dp"]
    results = []
    for index in range(len(CASES)):
        cfg, full, xs, gs = _case_data(index, state.dp_size)
        layer = MoELayer(cfg, state, layer_index=0)
        load_full_weights_(layer, full, state)
        x = xs[d].clone().requires_grad_(True)
        y, aux = layer(x)
        ((y * gs[d]).sum() + aux).backward()
        params = dict(layer.named_parameters())
        results.append(dict(y=y.detach(), aux=aux.detach(), dx=x.grad, stats=layer.last_stats,
                            grads={n: p.grad for n, p in params.items()},
                            meta={n: (p.meta.kind, p.meta.local_slices(state)) for n, p in params.items()}))
    comm = _balanced_layer_comm(state) if check_comm else None
    return results, comm


def _reference(index: int, dp: int):
    """Per micro-batch reference outputs, dL_d/dx_d, and weight gradients of mean_d L_d."""
    cfg, full, xs, gs = _case_data(index, dp)
    weights = {n: t.clone().requires_grad_(True) for n, t in full.items()}
    xs = [xs[d].reshape(B * S, H).clone().requires_grad_(True) for d in range(dp)]
    refs = [reference_moe(x, weights, cfg) for x in xs]
    loss = sum((ref.y * gs[d].reshape(B * S, H)).sum() + ref.aux_loss for d, ref in enumerate(refs)) / dp
    loss.backward()
    return refs, [x.grad * dp for x in xs], {n: w.grad for n, w in weights.items()}


def _check_eq1_volumes(forward, backward, layout: RankLayout):
    """Parm Eq. (1) per rank, bytes = 4 x elements (fp32). B L = B*S tokens per rank, M = H,
    T = k B L / E tokens per expert (dropless and perfectly balanced: f = 1), N_ESP = esp.
    Counters (distributed/collectives.py): an all-gather counts its gathered output, an
    all-reduce its tensor, an all-to-all this rank's whole input."""
    k, esp, ep, fp32, i64 = 2, layout.expert_shard, layout.expert, 4, 8
    blm = B * S * H
    etm = E * (k * B * S // E) * H
    assert forward == {
        "all_gather/esp": fp32 * blm * esp,  # AG_ESP(BLM x N_ESP): ESP-AllGather of the tokens
        "all_to_all/ep": 2 * fp32 * etm * esp,  # 2 x A2A_EP(ETM x N_ESP): dispatch + return
        "all_reduce/esp": fp32 * etm * esp,  # AR_ESP(ETM x N_ESP): partial sums of the ESP shards
        # routing metadata, beside Eq. (1): token counts, expert ids and combine weights of the
        # ESP group's tokens; per-expert counts of every EP rank (the all-to-all-v splits)
        "all_gather_routing/esp": i64 * esp + (i64 + fp32) * B * S * k * esp,
        "all_gather_counts/ep": i64 * E * ep,
    }
    # backward: ESP-Split -> all-gather of dy; both all-to-alls reversed; ESP-AllReduce -> none
    # (identity); ESP-AllGather -> reduce-scatter of the tokens' gradient
    assert backward == {
        "all_gather/esp": fp32 * blm * esp,
        "all_to_all/ep": 2 * fp32 * etm * esp,
        "reduce_scatter/esp": fp32 * blm * esp,
    }


@pytest.mark.distributed
@pytest.mark.parametrize("world,layout_kwargs", LAYOUTS, ids=lambda v: str(v))
def test_baseline_layer_equals_reference(world, layout_kwargs):
    layout = RankLayout(world_size=world, **layout_kwargs)
    check_comm = layout.tensor * layout.expert_shard > 1 and layout.expert > 1
    outputs = run_distributed(world, _run_cases, layout_kwargs, args=(check_comm,))
    dp = layout.data_parallel
    for index, case in enumerate(CASES):
        refs, ref_dx, ref_grads = _reference(index, dp)
        for rank in range(world):
            res = outputs[rank][0][index]
            d = layout.coords(rank)["dp"]
            torch.testing.assert_close(res["y"].reshape(B * S, H), refs[d].y.detach(), **FP32)
            torch.testing.assert_close(res["aux"], refs[d].aux_loss.detach(), **FP32)
            torch.testing.assert_close(res["dx"].reshape(B * S, H), ref_dx[d], **FP32)
            stats = res["stats"]
            assert stats.tokens_per_expert.tolist() == refs[d].tokens_per_expert
            assert stats.dropped == refs[d].dropped
            # computed per EP rank: kept assignments of every rank of this ep_esp group
            group_kept = torch.tensor([refs[layout.coords(q)["dp"]].kept_per_expert
                                       for q in layout.group_of("ep_esp", rank)]).sum(0)
            assert stats.tokens_per_ep_rank.tolist() == group_kept.view(layout.expert, -1).sum(1).tolist()
            for name, (kind, slices) in res["meta"].items():
                replicas = layout.group_of("edp" if kind == "expert" else "dp", rank)
                synced = sum(outputs[q][0][index]["grads"][name] for q in replicas) / dp
                torch.testing.assert_close(synced, ref_grads[name][slices], **FP32, msg=lambda m: f"{name}: {m}")
        if case[0] is not None:
            assert sum(ref.dropped for ref in refs) > 0, "capacity case dropped nothing"
    if check_comm:
        for forward, backward in (out[1] for out in outputs):
            _check_eq1_volumes(forward, backward, layout)
