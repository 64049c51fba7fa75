"""Host syncs per MoE layer forward for every schedule, token dispatch and balancer (issue #44 item 3).

One spawn of 4 CPU processes (gloo) runs, on three layouts, one MoE layer per configuration: a
forward and backward to warm up, then a forward counted twice: by the helper (`HOST_SYNCS`, every
host read the code means to make goes through `perf/host_sync.py`) and independently
(`tests/host_reads.py`: every `.item()`, `.tolist()`, `.cpu()`, `int()`, `bool()`, `nonzero`,
`bincount`, `unique`, boolean mask, ... of device data outside the helper). The independent
count must be 0 on every rank (the helper's reads are all there are), and the helper's count is
`EXPECTED`'s, on every rank; each number above 1 states why it cannot be 1.
"""
from pathlib import Path

import pytest
import torch

from megatron_moe.distributed.parallel_state import ParallelState, RankLayout
from megatron_moe.moe.layer import MoELayer
from megatron_moe.perf.host_sync import HOST_SYNCS
from tests.distributed.harness import BACKENDS, device, run_distributed
from tests.distributed.moe_cases import case_data
from tests.host_reads import HostReads
from tests.moe_reference import load_full_weights_

pytestmark = pytest.mark.distributed
PROFILE = str(Path(__file__).resolve().parents[2] / "configs/hardware/cpu_gloo_2proc.yaml")  # every op

TP2_EP2 = dict(tensor=2, expert=2)  # each TP group inside one ep_esp group
TP4_EP2 = dict(tensor=4, expert=2)  # a TP group spans two ep_esp groups
EP4_2NODES = dict(expert=4, ranks_per_node=2)
BASELINE = "1: the token counts [ep, E] that size the all-to-all and that the balancer plans from"
PLANNER = "1: the planner runs on the host, on the counts the baseline read (nothing else from the device)"
EXPECTED = {  # (layout, name): (configuration keys, host reads per forward (by Alg. 1's pick), why)
    ("tp2-ep2", "baseline"): ({}, 1, BASELINE),
    ("tp2-ep2", "smart"): ({"smart_schedule": True}, 1, BASELINE + "; every step's orders go down at once"),
    ("tp2-ep2", "fastermoe"): ({"balancer": "fastermoe"}, 1, PLANNER),
    ("tp2-ep2", "flexmoe"): ({"balancer": "flexmoe"}, 1, PLANNER),
    ("tp2-ep2", "eplb"): ({"balancer": "eplb"}, 1, PLANNER),
    ("tp2-ep2", "proprophet"): ({"balancer": "proprophet"}, 1, PLANNER),
    ("tp2-ep2", "s1"): ({"schedule": "s1"}, 1, "1: every ep_esp source's counts of its TP piece"),
    ("tp2-ep2", "s2"): ({"schedule": "s2"}, 1, "1: every source's chunk counts and the kept counts, one read"),
    ("tp2-ep2", "s2-saa"): ({"schedule": "s2", "saa": True}, 1,
                            "1: the TP peers' rows per EP rank come from this rank's placement"),
    ("tp2-ep2", "auto"): ({"schedule": "auto", "saa": True}, 1, "1: both candidates' counts in one read"),
    ("tp4-ep2", "s2-saa"): ({"schedule": "s2", "saa": True}, 2,
                            "2: + SAA's TP peers' rows per EP rank, planned in other ep_esp groups (exchanged)"),
    ("tp4-ep2", "auto"): ({"schedule": "auto", "saa": False}, 2,
                          "2: + Alg. 1's E T max-reduced over a TP group that spans ep_esp groups"),
    ("tp4-ep2", "auto-saa"): ({"schedule": "auto", "saa": True}, {"s1": 2, "s2": 3},
                              "2: + the E T max-reduce; 3 where Alg. 1 picks S2: + SAA's peers' rows"),
    ("ep4-2nodes", "node_dedup"): ({"token_dispatch": "node_dedup"}, 2,
                                   "2: + hop 1's rows per proxy: how many tokens share a node is not in the "
                                   "counts, and the rows arriving come from the other sources"),
}
LAYOUTS = {"tp2-ep2": TP2_EP2, "tp4-ep2": TP4_EP2, "ep4-2nodes": EP4_2NODES}


def _forward_reads(state, keys, index):
    cfg, full, xs, gs = case_data(index, state.dp_size)
    cfg.perf.hardware_profile = PROFILE
    for key, value in keys.items():
        setattr(cfg.moe, key, value)
    if keys.get("balancer") == "fastermoe":
        cfg.moe.fastermoe.min_shadow = 1  # a replica, so Trans / Agg run too
    layer = MoELayer(cfg, state, layer_index=0)
    load_full_weights_(layer, full, state)
    layer.to(device())
    d = state.layout.coords(state.rank)["dp"]
    x, g = xs[d].clone().to(device()).requires_grad_(True), gs[d].to(device())
    y, aux = layer(x)  # warm-up: one-time probes (grouped GEMM kernel) run here
    ((y * g).sum() + aux).backward()
    sync_debug = device().type == "cuda"
    if sync_debug:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # only the helper may sync (it allows its own copy)
    try:
        with HOST_SYNCS.counting() as helper, HostReads(list(layer.parameters()) + [x]) as independent:
            y, aux = layer(x)
    finally:
        if sync_debug:
            torch.cuda.set_sync_debug_mode("default")
    ((y * g).sum() + aux).backward()
    return (helper.reads, dict(helper.by_label), independent.reads, dict(independent.sites), independent.helper,
            layer.last_stats.schedule)


def _run(state):
    out = {}
    for name, kwargs in LAYOUTS.items():
        sub = ParallelState.build(RankLayout(world_size=state.world_size, **kwargs), state.rank)
        for (layout, what), (keys, _, _) in EXPECTED.items():
            if layout == name:
                out[(layout, what)] = [_forward_reads(sub, keys, index) for index in (0, 1)]  # dropless, capacity
    return out


@pytest.fixture(scope="module")
def spawned():
    results = {}

    def get(backend):
        if backend not in results:
            results[backend] = run_distributed(4, _run, backend=backend, timeout=600)
        return results[backend]
    return get


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout,what", list(EXPECTED), ids=[f"{a}-{b}" for a, b in EXPECTED])
def test_host_reads_per_layer_forward(layout, what, backend, spawned):
    _, expected, why = EXPECTED[(layout, what)]
    for rank, result in enumerate(spawned(backend)):
        for case, (reads, labels, others, sites, seen, ran) in zip(("dropless", "capacity"), result[(layout, what)]):
            where = f"{layout} {what} ({ran}) {case} rank {rank}"
            assert others == 0, f"{where}: host reads outside perf/host_sync.py: {sites}"
            assert seen == reads, f"{where}: the independent count saw {seen} helper reads, the helper {reads}"
            wanted = expected[ran] if isinstance(expected, dict) else expected
            assert reads == wanted, f"{where}: {reads} host reads ({labels}), expected {why}"
