"""The topology-aware gate (techniques/fastermoe/topology_gate.py) on simulated nodes (`ranks_per_node`): every
schedule it works with gives the single-process reference of the same gate (outputs, aux loss,
all gradients; dropless and capacity), and it sends fewer bytes across nodes than softmax top-k."""
import math

import pytest

from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.parallel_state import ParallelState, RankLayout
from tests.distributed.harness import BACKENDS, run_distributed
from tests.distributed.moe_cases import B, E, S, case_data, check_results, reference_of, run_layer
from tests.distributed.test_moe_parm import TESTBED_B

RATIO = 0.5
RUNS = [("baseline", 0), ("baseline", 1), ("s2", 2), ("auto", 3)]  # (schedule, case)
LAYOUTS = [(4, dict(expert=4, ranks_per_node=2)), (8, dict(tensor=2, expert=2, expert_shard=2, ranks_per_node=2))]


def _run(state, jobs):
    out = []
    for kwargs in jobs:
        sub = ParallelState.build(RankLayout(world_size=state.world_size, **kwargs), state.rank)
        results = []
        for gate in ("topology", "softmax"):
            for schedule, index in RUNS:
                cfg, full, xs, gs = case_data(index, sub.dp_size)
                cfg.moe.schedule, cfg.perf.hardware_profile, cfg.moe.gate = schedule, TESTBED_B, gate
                cfg.moe.topology_gate.bandwidth_ratio = RATIO
                C.COMM_STATS.reset()
                result = run_layer(sub, cfg, full, xs, gs)
                results.append((result, sum(C.COMM_STATS.inter_node.values())))
        out.append(results)
    return out


def _topology_reference(index: int, layout: RankLayout):
    """reference_of with each micro-batch's gate: its node is its TP group's first rank's; an
    expert is remote if its owner in that rank's EP group is on another node."""
    cfg, full, xs, gs = case_data(index, layout.data_parallel)
    per_node, budget = layout.ranks_per_node, math.floor(RATIO / layout.ranks_per_node * B * S * cfg.moe.top_k)
    masks = []
    for d in range(layout.data_parallel):
        first = layout.groups("tp")[d][0]
        members = layout.group_of("ep", first)
        masks.append([members[e // (E // layout.expert)] // per_node != first // per_node for e in range(E)])
    return reference_of(cfg, full, xs, gs, remote=masks, budget=budget)


@pytest.mark.distributed
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world,layout_kwargs", LAYOUTS, ids=["ep4-2nodes", "tp2-ep2-esp2-4nodes"])
def test_topology_gate_equals_its_reference_and_saves_inter_node_bytes(world, layout_kwargs, backend):
    layout = RankLayout(world_size=world, **layout_kwargs)
    outputs = run_distributed(world, _run, layout_kwargs, args=([layout_kwargs],), timeout=600, backend=backend)
    outputs = [out[0] for out in outputs]
    saved = 0
    for i, (schedule, index) in enumerate(RUNS):
        check_results([out[i][0] for out in outputs], _topology_reference(index, layout), layout,
                      f"topology {schedule} case {index}")
        topology = sum(out[i][1] for out in outputs)
        softmax = sum(out[len(RUNS) + i][1] for out in outputs)
        assert topology <= softmax, (schedule, index, topology, softmax)
        saved += softmax - topology
    assert saved > 0
