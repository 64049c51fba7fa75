"""The order in which overlapped work is issued (issue #27 items 9, 10): exactness tests pass for
a sequential implementation too, so these record, on 2 ranks (expert=2), when transfers are posted
relative to the computation they should overlap.

* FasterMoE's smart schedule (techniques/fastermoe/smart.py): step j+1's sends are posted before step j's
  expert computation ends (forward, S_j+1 before C_j ends) and step j+1's output gradients before
  step j's expert backward runs; under `torch.no_grad` the steps build no autograd graph.
* Pro-Prophet's block-wise scheduler (techniques/proprophet/cross_layer.py, Alg. 2): with a plan and replicas to
  fetch, SubTrans1 of layer 2 is issued before layer 1's expert computation and SubTrans2 before
  layer 2's; without `overlap` nothing is issued early. Both runs compute the same numbers.
* Its SubAgg1 / SubAgg2 (Alg. 2 lines 5, 12, 14): layer 2's Agg goes out in two parts, SubAgg1
  after layer 2's last backward all-to-all and before layer 1's first (the all-to-all calls
  counted so far), SubAgg2 after layer 1's combine all-to-all in backward and before its expert
  backward, both on the `ep` side channel; the bytes of each, tagged in `COMM_STATS.tagged`, are
  the formula's; gradients equal the single-process reference.
* Every Trans and Agg (issue #44 item 4) on `ep`'s side channel (counted as group "ep_side"), none
  on `ep` (whose communicator carries the token all-to-alls): FasterMoE with the smart schedule
  off and on, Pro-Prophet with `overlap` off and on (the prefetched SubTrans1 / SubTrans2, the split
  Agg, the first layer's whole Agg), two linked layers, two iterations, bytes and calls per group.

Recorded by wrapping, in the spawned worker, `collectives.p2p_exchange` (the smart schedule's
messages carry tag 2j for S_j and 2n + 2j for step j's output gradients), `cross_layer.start_trans`
(only the prefetch calls it under that name) and each layer's `experts.forward`.
"""
from dataclasses import replace

import pytest
import torch

from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.parallel_state import ParallelState, side_channels
from megatron_moe.moe.replicas import AGG_KIND, SUB_AGG_TAGS
from megatron_moe.moe.schedules import A2A_KINDS
from megatron_moe.techniques.proprophet import cross_layer
from megatron_moe.model.transformer import link_moe_layers
from megatron_moe.moe.layer import MoELayer
from megatron_moe.techniques.fastermoe.smart import SMART_KIND
from tests.distributed.harness import BACKENDS, device, run_distributed
from tests.distributed.moe_cases import B, FFN, FP32, H, S, case_data
from tests.moe_reference import load_full_weights_, random_full_weights, reference_moe

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
    return _two_layers(state, cfg, xs, gs)


def _shadowing(state, smart: bool) -> dict:
    """`_prefetch` with FasterMoE (>= 1 shadow), its smart schedule off or on."""
    cfg, _, xs, gs = case_data(0, state.dp_size)
    cfg.moe.balancer, cfg.perf.hardware_profile, cfg.moe.fastermoe.min_shadow = "fastermoe", PROFILE, 1
    cfg.moe.smart_schedule, cfg.moe.smart_group_size = smart, 1
    return _two_layers(state, cfg, xs, gs)


def _record_plans(layers) -> dict:
    """{layer: [the Placement each of its forwards planned]}, filled as they plan."""
    placed = {i: [] for i in range(len(layers))}
    for i, layer in enumerate(layers):
        plan = layer.balancer.plan
        layer.balancer.plan = lambda counts, sources, i=i, plan=plan: placed[i].append(plan(counts, sources)) or \
            placed[i][-1]
    return placed


def _two_layers(state, cfg, xs, gs) -> dict:
    """Two linked MoE layers of `cfg`, two iterations, on the side channels the trainer builds
    (`SIDE_CHANNELS`): the log, and per iteration the outputs, gradients, each layer's placement
    and this rank's bytes and calls per kind/group."""
    state = ParallelState.build(state.layout, state.rank, side_channels(cfg))
    layers = [_layer(cfg, state, i, random_full_weights(cfg, seed=10 + i)) for i in range(2)]
    link_moe_layers(layers)
    log, placed = [], _record_plans(layers)
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
            x, y = _step(layers, state, xs, gs, log, iteration)
            out.append(dict(y=y.detach(), dx=x.grad, replicas=[layer.last_stats.replicas for layer in layers],
                            grads={f"{i}.{n}": p.grad.clone() for i, layer in enumerate(layers)
                                   for n, p in layer.named_parameters()},
                            placed=[placed[i][-1].replicas for i in range(2)], bytes=C.COMM_STATS.snapshot(),
                            calls=dict(C.COMM_STATS.calls)))
            for layer in layers:
                layer.zero_grad(set_to_none=True)
    finally:
        cross_layer.start_trans = start
    return dict(log=log, runs=out, side_channel=state.ep.side_handle is not None)


def _a2a_calls() -> int:
    return sum(n for key, n in C.COMM_STATS.calls.items() if key.split("/")[0] in A2A_KINDS)


def _step(layers, state, xs, gs, log, iteration: int):
    """One iteration of two linked layers from reset counters (logs its start and the all-to-all
    calls of its forward): (this rank's input, the output)."""
    C.COMM_STATS.reset()
    log.append(("iteration", iteration))
    x = xs[state.dp.rank].clone().to(device()).requires_grad_(True)
    h, aux0 = layers[0](x)
    y, aux1 = layers[1](h)
    log.append(("forward a2a", _a2a_calls()))
    ((y * gs[state.dp.rank].to(device())).sum() + aux0 + aux1).backward()
    return x, y


def _sub_aggs(state) -> dict:
    """Two linked MoE layers (Pro-Prophet with its scheduler, >= 2 replicas a layer, the side
    channel its SIDE_CHANNELS entry asks for), two iterations. T_FNEC is set so that SubAgg1 fits
    one replicated expert's Agg (Eq. 5: Q / (2 B) each on 2 devices) and SubAgg2 takes the rest."""
    cfg, _, xs, gs = case_data(0, state.dp_size)
    cfg.moe.balancer, cfg.perf.hardware_profile = "proprophet", PROFILE
    cfg.moe.proprophet.min_replicas, cfg.moe.proprophet.overlap = 2, True
    sub = ParallelState.build(state.layout, state.rank, side_channels(cfg))
    full = [random_full_weights(cfg, seed=10 + i) for i in range(2)]
    layers = [_layer(cfg, sub, i, full[i]) for i in range(2)]
    model = layers[1].balancer.model
    layers[1].balancer.model = replace(model, fnec_seconds=0.75 * model.trans(1, 2))
    link_moe_layers(layers)
    log, placed = [], _record_plans(layers)
    for i, layer in enumerate(layers):
        _record_experts(layer, log, f"L{i}")
    reduce, post, torch_reduce = C.reduce_async, C.p2p_exchange, C.dist.reduce

    def reducing(t, dst_index, group, kind="reduce", sink=None):
        if kind == AGG_KIND:
            log.append(("agg", C.COMM_STATS.tag, group.name, _a2a_calls()))
        return reduce(t, dst_index, group, kind=kind, sink=sink)

    def posting(sends, recvs, group, kind="send", tag=0, sink=None, side=False):
        if kind == AGG_KIND and (sends or recvs):
            log.append(("agg", C.COMM_STATS.tag, group.name, _a2a_calls()))
        return post(sends, recvs, group, kind=kind, tag=tag, sink=sink, side=side)

    def on_handle(*args, group=None, **kwargs):  # the process group the reduce runs on
        log.append(("handle", "side" if group is sub.ep.side_handle else "ep" if group is sub.ep.handle else "?"))
        return torch_reduce(*args, group=group, **kwargs)

    C.reduce_async, C.p2p_exchange, C.dist.reduce = reducing, posting, on_handle
    out = []
    try:
        for iteration in range(2):
            x, y = _step(layers, sub, xs, gs, log, iteration)
            out.append(dict(y=y.detach(), dx=x.grad, tagged=dict(C.COMM_STATS.tagged), bytes=C.COMM_STATS.snapshot(),
                            replicas=[placed[i][-1].replicas for i in range(2)],
                            grads=[{n: p.grad.clone() for n, p in layer.named_parameters() if p.requires_grad}
                                   for layer in layers],
                            meta=[{n: (p.meta.kind, p.meta.local_slices(sub)) for n, p in layer.named_parameters()
                                   if p.requires_grad} for layer in layers]))
            for layer in layers:
                layer.zero_grad(set_to_none=True)
    finally:
        C.reduce_async, C.p2p_exchange, C.dist.reduce = reduce, post, torch_reduce
    return dict(log=log, runs=out, side_channel=sub.ep.side_handle is not None, full=full)


def _chain_reference(cfg, full, xs, gs):
    """Two MoE layers in a row on one process: per micro-batch y and dL_d/dx_d, and the weight
    gradients of the mean loss over the micro-batches (the trainer's average), per layer."""
    dp = xs.shape[0]
    weights = [{n: t.clone().requires_grad_(True) for n, t in w.items()} for w in full]
    inputs = [xs[d].reshape(B * S, H).clone().requires_grad_(True) for d in range(dp)]
    ys, loss = [], 0.0
    for d, x in enumerate(inputs):
        first = reference_moe(x, weights[0], cfg)
        second = reference_moe(first.y, weights[1], cfg)
        ys.append(second.y.detach())
        loss = loss + (second.y * gs[d].reshape(B * S, H)).sum() + first.aux_loss + second.aux_loss
    (loss / dp).backward()
    return ys, [x.grad * dp for x in inputs], [{n: w.grad for n, w in layer.items()} for layer in weights]


def _run(state):
    return dict(smart=_smart(state), prefetch={overlap: _prefetch(state, overlap) for overlap in (False, True)},
                shadow={smart: _shadowing(state, smart) for smart in (False, True)}, sub_agg=_sub_aggs(state))


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


@pytest.mark.distributed
@pytest.mark.parametrize("backend", BACKENDS)
def test_proprophet_issues_sub_agg1_and_sub_agg2_where_alg_2_places_them(backend, spawned):
    """Alg. 2 lines 12-15 for block 1 (layer 1) and layer 2's Agg in iteration 2 (the first has no
    plan: every Agg goes out whole, on ep, untagged). F = the all-to-alls of both forwards; backward
    runs layer 2's combine (F+1) and dispatch (F+2) all-to-alls, then layer 1's (F+3, F+4). On 2 EP
    ranks every replica is on both, so each expert's Agg is a reduce per parameter (4: w1, w2, b1,
    b2), of Q = 144 elements (576 bytes) in all, sent by the rank that is not its owner."""
    outputs = spawned(backend)
    params, expert_bytes = 4, (H * FFN + FFN * H + FFN + H) * 4
    cfg, _, xs, gs = case_data(0, 2)
    ys, dxs, grads = _chain_reference(cfg, outputs[0]["sub_agg"]["full"], xs, gs)
    group_tagged = {tag: 0 for tag in SUB_AGG_TAGS}
    for rank, out in enumerate(outputs):
        result = out["sub_agg"]
        assert result["side_channel"], rank  # SIDE_CHANNELS: proprophet + overlap -> a side channel of ep
        cut = result["log"].index(("iteration", 1))
        earlier, log = result["log"][:cut], result["log"][cut:]
        assert result["runs"][0]["tagged"] == {} and {e[1:3] for e in earlier if e[0] == "agg"} == {(None, "ep_side")}
        run = result["runs"][1]
        layer1, layer2 = ([e for e, ranks in enumerate(replicas) if len(ranks) > 1] for replicas in run["replicas"])
        assert len(layer2) >= 2, run["replicas"]
        sub1, sub2 = layer2[:1], layer2[1:]  # T_BNEC fits one expert's Eq. 5 time (`_sub_aggs`)

        def sent(layer: int, experts) -> int:  # Agg bytes this rank sends: the experts it holds a replica of
            return sum(rank in run["replicas"][layer][e][1:] for e in experts) * expert_bytes

        expected = {SUB_AGG_TAGS[0]: sent(1, sub1), SUB_AGG_TAGS[1]: sent(1, sub2)}
        assert {tag: run["tagged"].get(f"agg/ep_side#{tag}", 0) for tag in SUB_AGG_TAGS} == expected, \
            (rank, run["tagged"])
        assert run["bytes"]["agg/ep_side"] == sent(0, layer1) + sum(expected.values()), rank  # "agg" counts them all
        assert "agg/ep" not in run["bytes"], rank
        for tag in SUB_AGG_TAGS:
            group_tagged[tag] += expected[tag]
        # issue order (tag, group, all-to-alls so far): SubAgg1 between layer 2's last and layer 1's
        # first backward all-to-all (line 12), SubAgg2 right after layer 1's (line 14), then layer
        # 1's own Agg, whole (no block before it); all on the side channel
        F = next(entry[1] for entry in log if entry[0] == "forward a2a")
        issued = [entry[1:] for entry in log if entry[0] == "agg"]
        side = "ep_side"
        assert issued == ([(SUB_AGG_TAGS[0], side, F + 2)] * params * len(sub1) + [(SUB_AGG_TAGS[1], side, F + 3)]
                          * params * len(sub2) + [(None, side, F + 3)] * params * len(layer1)), (rank, log)
        handles = [entry[1] for entry in log if entry[0] == "handle"]  # the process group each reduce ran on
        assert handles == ["side"] * params * (len(layer2) + len(layer1)), (rank, log)
        last_sub_agg = max(i for i, entry in enumerate(log) if entry[0] == "agg" and entry[1] is not None)
        assert last_sub_agg < log.index(("L0", "backward", 1)), (rank, log)  # before layer 1's expert backward
    assert group_tagged == {SUB_AGG_TAGS[0]: expert_bytes, SUB_AGG_TAGS[1]: expert_bytes * (len(layer2) - 1)}
    # exact: both iterations equal the single-process reference of the two layers
    for iteration in range(2):
        for rank, out in enumerate(outputs):
            run = out["sub_agg"]["runs"][iteration]
            torch.testing.assert_close(run["y"].reshape(B * S, H), ys[rank], **FP32)
            torch.testing.assert_close(run["dx"].reshape(B * S, H), dxs[rank], **FP32)
            for layer in range(2):
                for name, (kind, slices) in run["meta"][layer].items():
                    group = [rank] if kind == "expert" else [0, 1]  # the trainer's sum: edp = this rank, dp = both
                    synced = sum(outputs[q]["sub_agg"]["runs"][iteration]["grads"][layer][name] for q in group) / 2
                    torch.testing.assert_close(synced, grads[layer][name][slices], **FP32,
                                               msg=lambda m, name=name: f"iteration {iteration} {layer}.{name}: {m}")


@pytest.mark.distributed
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_trans_and_agg_runs_on_the_ep_side_channel_none_on_ep(backend, spawned):
    """Issue #44 item 4, per rank and iteration: bytes and calls of "trans" / "agg" under group
    "ep_side" only. On 2 EP ranks every replica is on both, so per replicated expert of either layer
    Trans is a broadcast per parameter (4: w1, w2, b1, b2) of Q = 144 elements, 576 bytes counted
    at the owner, and Agg a reduce per parameter, 576 bytes counted at the other rank; each rank
    makes 4 calls per replicated expert of each."""
    params, expert_bytes = 4, (H * FFN + FFN * H + FFN + H) * 4
    for rank, out in enumerate(spawned(backend)):
        runs = {**{f"proprophet overlap={o}": r for o, r in out["prefetch"].items()},
                **{f"fastermoe smart={m}": r for m, r in out["shadow"].items()}}
        for name, result in runs.items():
            assert result["side_channel"], (rank, name)  # SIDE_CHANNELS asks for one with either balancer
            for iteration, run in enumerate(result["runs"]):
                where = (rank, name, iteration)
                replicated = [[ranks for ranks in layer if len(ranks) > 1] for layer in run["placed"]]
                assert all(len(ranks) == 2 for layer in replicated for ranks in layer), where
                experts = sum(len(layer) for layer in replicated)
                assert experts >= 1, where
                owned = sum(ranks[0] == rank for layer in replicated for ranks in layer)
                got = {key: (run["bytes"].get(key, 0), run["calls"].get(key, 0))
                       for key in ("trans/ep", "agg/ep", "trans/ep_side", "agg/ep_side")}
                assert got == {"trans/ep": (0, 0), "agg/ep": (0, 0),
                               "trans/ep_side": (owned * expert_bytes, params * experts),
                               "agg/ep_side": ((experts - owned) * expert_bytes, params * experts)}, (where, got)
    for out in spawned(backend):  # the smart schedule computes the same numbers
        plain, smart = out["shadow"][False]["runs"], out["shadow"][True]["runs"]
        for a, b in zip(plain, smart):
            for key in ("y", "dx"):
                torch.testing.assert_close(b[key], a[key], **FP32)
            for name, grad in a["grads"].items():
                torch.testing.assert_close(b["grads"][name], grad, **FP32, msg=lambda m, name=name: f"{name}: {m}")
