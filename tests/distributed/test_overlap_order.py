"""The order in which overlapped work is issued (issue #27 items 9, 10): exactness tests pass for
a sequential implementation too, so these record, on 2 ranks (expert=2), when transfers are posted
relative to the computation they should overlap.

* FasterMoE's smart schedule (techniques/fastermoe/smart.py): step j+1's sends are posted before step j's
  expert computation ends (forward, S_j+1 before C_j ends) and step j+1's output gradients before
  step j's expert backward runs; under `torch.no_grad` the steps build no autograd graph.
* Pro-Prophet's block-wise scheduler (techniques/proprophet/cross_layer.py, Alg. 2): with a plan and replicas to
  fetch, SubTrans1 of layer 2 is issued before layer 1's expert computation and SubTrans2 before
  layer 2's; without `overlap` nothing is issued early. Both runs compute the same numbers.

Recorded by wrapping, in the spawned worker, `collectives.p2p_exchange` (the smart schedule's
messages carry tag 2j for S_j and 2n + 2j for step j's output gradients), `cross_layer.start_trans`
(only the prefetch calls it under that name) and each layer's `experts.forward`.
"""
import pytest
import torch

from megatron_moe.distributed import collectives as C
from megatron_moe.techniques.proprophet import cross_layer
from megatron_moe.model.transformer import link_moe_layers
from megatron_moe.moe.layer import MoELayer
from megatron_moe.techniques.fastermoe.smart import SMART_KIND
from tests.distributed.harness import BACKENDS, device, run_distributed
from tests.distributed.moe_cases import FP32, case_data
from tests.moe_reference import load_full_weights_, random_full_weights

PROFILE = "configs/hardware/cpu_gloo_2proc.yaml"


def _layer(cfg, state, index: int, full) -> MoELayer:
    layer = MoELayer(cfg, state, layer_index=index)
    load_full_weights_(layer, full, state)
    return layer.to(device())


def _record_experts(layer, log, tag) -> None:
    """Log (tag, "compute", call, grad mode) / (tag, "computed", call) around each expert forward
    and (tag, "backward", call) when its output's gradient arrives."""
    forward = layer.experts.forward

    def recorded(batch, replicas=None, grad_scale=1.0):
        call = sum(1 for entry in log if entry[:2] == (tag, "compute"))
        log.append((tag, "compute", call, torch.is_grad_enabled()))
        out = forward(batch, replicas, grad_scale)
        if out.requires_grad:
            out.register_hook(lambda grad, call=call: log.append((tag, "backward", call)))
        log.append((tag, "computed", call))
        return out

    layer.experts.forward = recorded


def _smart(state) -> dict:
    cfg, full, xs, gs = case_data(0, state.dp_size)
    cfg.moe.smart_schedule, cfg.moe.smart_group_size = True, 1
    layer, log = _layer(cfg, state, 0, full), []
    _record_experts(layer, log, "C")
    post = C.p2p_exchange

    def posting(sends, recvs, group, kind="send", tag=0, sink=None):
        if kind == SMART_KIND:
            log.append(("S", "post", tag))
        return post(sends, recvs, group, kind=kind, tag=tag, sink=sink)

    C.p2p_exchange = posting
    try:
        x = xs[state.dp.rank].clone().to(device()).requires_grad_(True)
        y, aux = layer(x)
        ((y * gs[state.dp.rank].to(device())).sum() + aux).backward()
        trained, log[:] = list(log), []
        with torch.no_grad():
            y_eval, _ = layer(x)
    finally:
        C.p2p_exchange = post
    return dict(log=trained, no_grad=list(log), y=y.detach(), y_eval=y_eval, eval_grad_fn=y_eval.grad_fn is None)


def _prefetch(state, overlap: bool) -> dict:
    """Two linked MoE layers (Pro-Prophet, a plan every forward, >= 1 replica), two iterations."""
    cfg, _, xs, gs = case_data(0, state.dp_size)
    cfg.moe.balancer, cfg.perf.hardware_profile = "proprophet", PROFILE
    cfg.moe.proprophet.min_replicas, cfg.moe.proprophet.overlap = 1, overlap
    layers = [_layer(cfg, state, i, random_full_weights(cfg, seed=10 + i)) for i in range(2)]
    link_moe_layers(layers)
    log = []
    for i, layer in enumerate(layers):
        _record_experts(layer, log, f"L{i}")
    owner = {id(layer.experts): i for i, layer in enumerate(layers)}
    start = cross_layer.start_trans

    def prefetching(experts, replicas, state, sink=None):
        log.append(("T", owner[id(experts)], [e for e, ranks in enumerate(replicas) if len(ranks) > 1]))
        return start(experts, replicas, state, sink)

    cross_layer.start_trans = prefetching
    out = []
    try:
        for iteration in range(2):
            log.append(("iteration", iteration))
            x = xs[state.dp.rank].clone().to(device()).requires_grad_(True)
            h, aux0 = layers[0](x)
            y, aux1 = layers[1](h)
            ((y * gs[state.dp.rank].to(device())).sum() + aux0 + aux1).backward()
            out.append(dict(y=y.detach(), dx=x.grad, replicas=[layer.last_stats.replicas for layer in layers],
                            grads={f"{i}.{n}": p.grad.clone() for i, layer in enumerate(layers)
                                   for n, p in layer.named_parameters()}))
            for layer in layers:
                layer.zero_grad(set_to_none=True)
    finally:
        cross_layer.start_trans = start
    return dict(log=log, runs=out)


def _run(state):
    return dict(smart=_smart(state), prefetch={overlap: _prefetch(state, overlap) for overlap in (False, True)})


@pytest.fixture(scope="module")
def spawned():
    cache = {}

    def get(backend):
        if backend not in cache:
            cache[backend] = run_distributed(2, _run, dict(expert=2), backend=backend)
        return cache[backend]

    return get


@pytest.mark.distributed
@pytest.mark.parametrize("backend", BACKENDS)
def test_smart_schedule_posts_the_next_steps_transfers_before_this_steps_compute_ends(backend, spawned):
    for rank, out in enumerate(spawned(backend)):
        log, steps = out["smart"]["log"], 2  # ep 2, groups of 1 EP rank: own rows, then the peer's
        at = {entry[:3]: i for i, entry in enumerate(log)}
        assert [entry[2] for entry in log if entry[1] == "compute"] == list(range(steps)), (rank, log)
        for j in range(steps - 1):
            # forward: S_j+1 (tag 2(j+1)) in flight while C_j computes
            assert at[("S", "post", 2 * (j + 1))] < at[("C", "computed", j)], (rank, j, log)
            # backward: step j+1's output gradients (tag 2n + 2(j+1)) posted before step j's backward
            assert at[("S", "post", 2 * steps + 2 * (j + 1))] < at[("C", "backward", j)], (rank, j, log)
        # evaluation under torch.no_grad: no step builds a graph, the output is the same
        assert [entry[3] for entry in out["smart"]["no_grad"] if entry[1] == "compute"] == [False] * steps, rank
        assert out["smart"]["eval_grad_fn"]
        torch.testing.assert_close(out["smart"]["y_eval"], out["smart"]["y"], **FP32)


@pytest.mark.distributed
@pytest.mark.parametrize("backend", BACKENDS)
def test_proprophet_issues_the_next_layers_trans_before_this_layers_expert_compute(backend, spawned):
    for rank, out in enumerate(spawned(backend)):
        plain, overlapped = out["prefetch"][False], out["prefetch"][True]
        assert not any(entry[0] == "T" for entry in plain["log"]), rank  # no scheduler: nothing early
        second = overlapped["log"][overlapped["log"].index(("iteration", 1)):]
        at = {entry[:3]: i for i, entry in enumerate(second) if entry[0] != "T"}
        trans = [(i, entry) for i, entry in enumerate(second) if entry[0] == "T"]
        assert [entry[1] for _, entry in trans] == [1, 1], (rank, second)  # SubTrans1, SubTrans2 of layer 2
        (first, (_, _, head)), (then, (_, _, rest)) = trans
        assert overlapped["runs"][1]["replicas"][1] >= 1 and head + rest, (rank, trans)  # replicas to fetch
        assert first < at[("L0", "compute", 1)], (rank, second)  # SubTrans1 before FEC of layer 1
        assert at[("L0", "computed", 1)] < then < at[("L1", "compute", 1)], (rank, second)  # SubTrans2 in FNEC
        # the first forward has no plan yet: nothing early
        assert not any(entry[0] == "T" for entry in overlapped["log"][:overlapped["log"].index(("iteration", 1))])
        for a, b in zip(plain["runs"], overlapped["runs"]):  # the same numbers either way
            assert a["replicas"] == b["replicas"], rank
            for key in ("y", "dx"):
                torch.testing.assert_close(b[key], a[key], **FP32)
            for name, grad in a["grads"].items():
                torch.testing.assert_close(b["grads"][name], grad, **FP32, msg=lambda m, name=name: f"{name}: {m}")
