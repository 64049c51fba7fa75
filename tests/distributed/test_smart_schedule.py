"""FasterMoE's smart schedule (techniques/fastermoe/smart.py) == the single-process reference, with every
schedule it composes with, with and without replicas, dropless and with capacity drops.

The pairwise steps replace each schedule's all-to-all pair: no all-to-all bytes remain, and the
rows a rank sends point to point are the plain all-to-all's rows minus those it keeps. That the
steps are pipelined (a sequential exchange would pass here) and that evaluation builds no graphs:
tests/distributed/test_overlap_order.py.
"""
import pytest

from megatron_moe.distributed.parallel_state import RankLayout
from tests.distributed.harness import BACKENDS, per_world_spawner
from tests.distributed.moe_cases import check_against_reference, run_on_layouts
from tests.distributed.test_moe_parm import TESTBED_B
from tests.distributed.test_replicas import ReplicateOne, ShadowFixed

RUNS = [  # (schedule, case, balancer, smart_group_size)
    ("baseline", 0, None, 1), ("baseline", 1, ShadowFixed, 1), ("s1", 2, None, 1), ("s1", 1, ReplicateOne, 2),
    ("s2", 0, ReplicateOne, 1), ("s2", 3, None, 2), ("auto", 1, ShadowFixed, 1),
    ("s2", 4, ShadowFixed, 2), ("s1", 5, None, 1),  # router variants + shared experts (moe_cases.VARIANTS)
]
LAYOUTS = [(2, dict(expert=2)), (4, dict(expert=4)), (8, dict(tensor=2, expert=2, expert_shard=2))]


def _setup(run):
    schedule, index, balancer, group_size = run

    def edit(cfg, sub):
        cfg.moe.schedule, cfg.perf.hardware_profile = schedule, TESTBED_B
        cfg.moe.smart_schedule, cfg.moe.smart_group_size = True, min(group_size, sub.ep_size)
        return balancer(cfg, sub) if balancer else None

    return index, edit


def _run(state, jobs):
    return run_on_layouts(state, jobs, RUNS, _setup)


@pytest.fixture(scope="module")
def spawned():
    return per_world_spawner(LAYOUTS, _run)


@pytest.mark.distributed
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world,layout_kwargs", LAYOUTS, ids=["ep2", "ep4", "tp2-ep2-esp2"])
def test_smart_schedule_equals_reference(world, layout_kwargs, backend, spawned):
    layout = RankLayout(world_size=world, **layout_kwargs)
    outputs = spawned(world, backend)[str(layout_kwargs)]
    for i, (schedule, index, balancer, group_size) in enumerate(RUNS):
        label = f"smart {schedule} {getattr(balancer, '__name__', 'none')} g={group_size}"
        check_against_reference([out[i][0] for out in outputs], index, layout, label)
        for rank, out in enumerate(outputs):
            nbytes = out[i][1]
            assert not any(key.startswith("all_to_all") for key in nbytes), (label, rank, nbytes)
            assert nbytes.get("smart_p2p/ep" if schedule == "baseline" else "smart_p2p/ep_esp", 0) > 0, (label, rank)
