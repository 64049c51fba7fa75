"""Node-deduplicated dispatch (`moe.token_dispatch: node_dedup`, techniques/node_dedup/node_dedup.py)
== the single-process reference, and its bytes. One spawn of 4 CPU processes (gloo) runs:

1. The MoE layer (moe_cases.run_layer) on simulated nodes (`ranks_per_node`), every case of
   moe_cases (dropless and capacity; the DeepSeek-V3-like router with group-limited routing and
   a shared expert), with balancer none, per-iteration replicas (FasterMoE's shadowing and a
   Pro-Prophet-style split: test_replicas' fixed policies; `moe.balancer=proprophet` with its
   Plan while hop 1 is in flight), vExpert slots (EPLB, test_vexperts' table: expert 0 on three
   EP ranks of both nodes), the topology gate and Lancet's deferred dW, on three layouts: expert 4
   on 2 nodes (2 EP ranks per node: proxies forward to a node-mate), expert 2 x expert_shard 2 on
   2 nodes (one EP rank per node), tensor 2 x expert 2 with one rank per node. Outputs, aux loss,
   input and every parameter gradient (the router's included: its combine weights' gradient
   comes back from the proxies) equal the reference (rel 1e-5).
2. The bytes, at expert 4 on 2 nodes with router_groups=2 (a group = a node) and
   router_group_topk 2 and 1, per copy and node-deduplicated: every rank's counters (bytes and
   inter-node bytes of every kind, forward + backward) equal the count from the reference's
   routing (`_expected_bytes`, written from the formula in docs/node_dedup.md): hop 1 and its
   metadata under the `ep` group, hop 2 under `ep_node` (the node's members of the ep group: no
   inter-node byte; 2 calls forward and 2 backward, as hop 1's on `ep`). Inter-node all-to-all
   bytes fall as router_group_topk falls with node_dedup, and are below per copy's.
3. The whole GPT-MoE through the trainer (node_dedup with Lancet's partitioned forward, deferred
   dW and Pro-Prophet's block-wise scheduler; node_dedup with full recomputation, EPLB and capacity
   drops): loss, aux loss, grad norm and every synced gradient equal one process.

On GPUs (`make test-gpu`) the same spawn runs on NCCL, one process per GPU (4 GPUs), against the
same CPU references: every test is parametrized over `BACKENDS` by the module's `backend` fixture.
"""
import pytest
import torch

from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.parallel_state import ParallelState, RankLayout
from tests.distributed.harness import BACKENDS, run_distributed
from tests.distributed.moe_cases import (CASES, E, H, case_data, check_against_reference, check_results, reference_of,
                                         run_layer)
from tests.distributed.test_grads import _model_config, _trainer_grads
from tests.distributed.test_moe_parm import TESTBED_B
from tests.distributed.test_replicas import ReplicateOne, ShadowFixed, _fastermoe_profile
from tests.distributed.test_topology_gate import _topology_reference
from tests.distributed.test_vexperts import check_slot_results, layer_run

pytestmark = pytest.mark.distributed

EP4 = dict(expert=4, ranks_per_node=2)
LAYOUTS = {"ep4-2nodes": EP4, "ep2-esp2-2nodes": dict(expert=2, expert_shard=2, ranks_per_node=2),
           "tp2-ep2-4nodes": dict(tensor=2, expert=2, ranks_per_node=1)}
# (layout, what, case): what = none | shadow | one | proprophet | eplb | topology | lancet
LAYER_RUNS = [("ep4-2nodes", "none", i) for i in range(len(CASES))] + [
    ("ep4-2nodes", "shadow", 0), ("ep4-2nodes", "one", 1), ("ep4-2nodes", "proprophet", 5),
    ("ep4-2nodes", "eplb", 0), ("ep4-2nodes", "eplb", 1), ("ep4-2nodes", "topology", 1), ("ep4-2nodes", "lancet", 1),
    ("ep2-esp2-2nodes", "none", 0), ("ep2-esp2-2nodes", "none", 1), ("ep2-esp2-2nodes", "one", 4),
    ("tp2-ep2-4nodes", "none", 0), ("tp2-ep2-4nodes", "none", 5), ("tp2-ep2-4nodes", "shadow", 1),
]
BYTE_RUNS = [(dispatch, topk) for topk in (2, 1) for dispatch in ("per_copy", "node_dedup")]
RATIO = 0.5  # the topology gate's bandwidth ratio (test_topology_gate's)
PROFILE = "perf.hardware_profile=configs/hardware/cpu_gloo_2proc.yaml"
TRAINER_RUNS = [
    ["moe.lancet.partitions=2", "moe.lancet.partition_range=1", "moe.lancet.defer_wgrad=true",
     "moe.balancer=proprophet", "moe.proprophet.overlap=true", "moe.proprophet.min_replicas=1", PROFILE],
    ["training.recompute=full", "moe.balancer=eplb", "moe.capacity_factor=1.0"],
]


def _layer(sub: ParallelState, what: str, index: int, profile: str):
    if what == "eplb":
        return layer_run(sub, ("baseline", False, False, index), token_dispatch="node_dedup")
    cfg, full, xs, gs = case_data(index, sub.dp_size)
    cfg.moe.token_dispatch, cfg.perf.hardware_profile = "node_dedup", TESTBED_B
    balancer = {"shadow": ShadowFixed, "one": ReplicateOne}.get(what)
    if what == "proprophet":
        cfg.moe.balancer, cfg.moe.proprophet.min_replicas, cfg.moe.proprophet.overlap = "proprophet", 1, True
        cfg.perf.hardware_profile = profile
    if what == "topology":
        cfg.moe.gate, cfg.moe.topology_gate.bandwidth_ratio = "topology", RATIO
    cfg.moe.lancet.defer_wgrad = what == "lancet"
    return run_layer(sub, cfg, full, xs, gs, balancer=balancer(cfg, sub) if balancer else None)


def _byte_config(dispatch: str, topk: int):
    """Case 0 (k = 2, dropless) with 2 router groups of 2 experts: one group = one node's experts."""
    cfg, full, xs, gs = case_data(0, 4)
    cfg.moe.token_dispatch, cfg.moe.router_groups, cfg.moe.router_group_topk = dispatch, 2, topk
    return cfg, full, xs, gs


def _run(state, profile):
    subs = {name: ParallelState.build(RankLayout(world_size=4, **kwargs), state.rank)
            for name, kwargs in LAYOUTS.items()}
    layers = [_layer(subs[name], what, index, profile) for name, what, index in LAYER_RUNS]
    counted = []
    for dispatch, topk in BYTE_RUNS:
        C.COMM_STATS.reset()
        result = run_layer(subs["ep4-2nodes"], *_byte_config(dispatch, topk))
        counted.append((result, C.COMM_STATS.snapshot(), dict(C.COMM_STATS.inter_node), dict(C.COMM_STATS.calls)))
    ep4 = subs["ep4-2nodes"]
    trainer = [_trainer_grads(_model_config(EP4, ["moe.token_dispatch=node_dedup"] + run), ep4) for run in TRAINER_RUNS]
    return layers, counted, trainer


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture(scope="module")
def spawned(tmp_path_factory, backend):
    profile = _fastermoe_profile(str(tmp_path_factory.mktemp("node_dedup") / "profile.yaml"))
    return run_distributed(4, _run, EP4, args=(profile,), timeout=600, backend=backend)


def test_layer_equals_reference(spawned):
    for i, (name, what, index) in enumerate(LAYER_RUNS):
        layout, label = RankLayout(world_size=4, **LAYOUTS[name]), f"node_dedup {name} {what} case {index}"
        results = [out[0][i] for out in spawned]
        if what == "eplb":
            check_slot_results(results, layout, index, label)
        elif what == "topology":
            check_results(results, _topology_reference(index, layout), layout, label)
        else:
            check_against_reference(results, index, layout, label)


def _expected_bytes(kept, dispatch: str):
    """Per EP rank q of expert 4 on 2 nodes (owner of expert e: rank e; node of rank q: q // 2; the
    proxy of source s on node N: s on its own node, else rank 2 N + s % 2), from kept[s][t] (the
    reference's kept experts of token t of micro-batch s = source s): ({kind/group: bytes},
    {kind/group: inter-node bytes}) of one forward and backward (fp32; int64 codes and counts).
    node_dedup: hop 1 (+ back) on `ep`, hop 2 (+ back) on `ep_node` = {0, 1} or {2, 3}."""
    row, k, ep = 4 * H, 2, 4
    node = [q // 2 for q in range(ep)]

    def proxy(s, n):
        return s if node[s] == n else 2 * n + s % 2

    out = []
    for q in range(ep):
        computed = sum(e == q for s in range(ep) for t in kept[s] for e in t)  # M_q
        computed_off = sum(e == q for s in range(ep) if node[s] != node[q] for t in kept[s] for e in t)
        if dispatch == "per_copy":
            copies = sum(len(t) for t in kept[q])  # C_q
            copies_off = sum(node[e] != node[q] for t in kept[q] for e in t)
            sent, inter = {"all_to_all/ep": copies + computed}, {"all_to_all/ep": copies_off + computed_off}
            sent = {key: 2 * row * v for key, v in sent.items()}  # forward + backward, same rows
            inter = {key: 2 * row * v for key, v in inter.items() if v}
        else:
            pairs = [(t, n) for t in kept[q] for n in sorted({node[e] for e in t})]  # R_q: (token, node)
            pairs_off = sum(n != node[q] for _, n in pairs)
            received = [(s, t) for s in range(ep) for t in kept[s] if proxy(s, node[q]) == q
                        and node[q] in {node[e] for e in t}]  # R'_q: rows q receives as a proxy
            received_off = sum(node[s] != node[q] for s, _ in received)
            forwarded = sum(node[e] == node[q] for _, t in received for e in t)  # F_q
            sent = {"all_to_all/ep": 2 * row * (len(pairs) + len(received)),  # hop 1 + hop 1 back
                    "all_to_all/ep_node": 2 * row * (forwarded + computed),  # hop 2 + hop 2 back
                    "all_to_all_routing/ep": k * (8 + 4) * len(pairs) + k * 4 * len(received),
                    "all_to_all_counts/ep": 8 * ep}
            inter = {"all_to_all/ep": 2 * row * (pairs_off + received_off),
                     "all_to_all_routing/ep": k * (8 + 4) * pairs_off + k * 4 * received_off,
                     "all_to_all_counts/ep": 8 * (ep - 2)}
            inter = {key: v for key, v in inter.items() if v}
        sent["all_gather_counts/ep"] = 8 * E * ep
        out.append((sent, inter))
    return out


def test_bytes_equal_the_count_from_the_routing_and_fall_with_router_group_topk(spawned):
    layout = RankLayout(world_size=4, **EP4)
    inter_a2a = {}
    for i, (dispatch, topk) in enumerate(BYTE_RUNS):
        label = f"{dispatch} router_group_topk={topk}"
        refs = check_results([out[1][i][0] for out in spawned], reference_of(*_byte_config(dispatch, topk)), layout,
                             label)
        kept = [ref.kept for ref in refs]
        if topk == 1:  # group-limited: a token's experts on one node
            assert all(len({e // 2 for e in t}) == 1 for s in kept for t in s)
        for rank, (sent, inter) in enumerate(_expected_bytes(kept, dispatch)):
            _, got_sent, got_inter, got_calls = spawned[rank][1][i]
            assert got_sent == sent, (label, rank, got_sent, sent)
            assert got_inter == inter, (label, rank, got_inter, inter)
            # token rows: per copy one exchange each way on ep; node_dedup hop 1 each way on ep and
            # hop 2 each way on ep_node; each once forward and once backward
            calls = {key: n for key, n in got_calls.items() if key.startswith("all_to_all/")}
            expected = {"all_to_all/ep": 4} if dispatch == "per_copy" else {"all_to_all/ep": 4, "all_to_all/ep_node": 4}
            assert calls == expected, (label, rank, got_calls)
        inter_a2a[(dispatch, topk)] = sum(out[1][i][2].get("all_to_all/ep", 0) for out in spawned)
        per_group = {key: sum(out[1][i][1].get(key, 0) for out in spawned)
                     for key in ("all_to_all/ep", "all_to_all/ep_node")}
        print(f"{label}: all_to_all bytes of the 4 ranks (forward + backward): {per_group}, "
              f"inter-node {inter_a2a[(dispatch, topk)]}")
    assert inter_a2a[("node_dedup", 1)] < inter_a2a[("node_dedup", 2)] <= inter_a2a[("per_copy", 2)]
    assert inter_a2a[("node_dedup", 1)] < inter_a2a[("per_copy", 1)]


def test_model_through_the_trainer_equals_one_process(spawned):
    for i, run in enumerate(TRAINER_RUNS):
        capacity = [o for o in run if o.startswith("moe.capacity_factor")]
        ref_loss, ref_aux, ref_norm, ref_grads = _trainer_grads(_model_config({}, capacity),
                                                                ParallelState.single_process())
        for rank, out in enumerate(spawned):
            loss, aux, norm, grads = out[2][i]
            where = f"{run} rank {rank}"
            assert loss == pytest.approx(ref_loss, rel=1e-5), where
            assert aux == pytest.approx(ref_aux, rel=1e-4, abs=1e-7), where
            assert norm == pytest.approx(ref_norm, rel=1e-4), where
            assert grads.keys() == ref_grads.keys(), where
            for name, (slices, grad) in grads.items():
                torch.testing.assert_close(torch.from_numpy(grad), torch.from_numpy(ref_grads[name][1][slices]),
                                           rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{where} {name}: {m}")
