"""Lancet's deferred weight gradients (moe/lancet.py, `moe.lancet.defer_wgrad`) == the
single-process reference under every schedule, dropless and with capacity drops: the experts' w1 /
w2 gradients are computed while the backward all-to-alls are in flight (or at the end of backward)
and must equal the plain run's."""
import pytest

from megatron_moe.distributed.parallel_state import RankLayout
from tests.distributed.harness import per_world_spawner
from tests.distributed.moe_cases import check_against_reference, run_on_layouts
from tests.distributed.test_moe_parm import TESTBED_B

LAYOUTS = [(2, dict(expert=2)), (4, dict(tensor=2, expert=2, expert_shard=2))]
RUNS = [  # (schedule, saa, smart schedule, case)
    ("baseline", False, False, 0), ("baseline", False, False, 1), ("s1", False, False, 2), ("s2", True, False, 1),
    ("auto", True, False, 0), ("s2", False, True, 3),
]


def _run(state, jobs):
    def setup(run):
        schedule, saa, smart, index = run

        def edit(cfg, sub):
            cfg.moe.schedule, cfg.moe.saa, cfg.perf.hardware_profile = schedule, saa, TESTBED_B
            cfg.moe.smart_schedule = smart
            cfg.moe.lancet.defer_wgrad = True
            return None

        return index, edit

    return run_on_layouts(state, jobs, RUNS, setup)


@pytest.fixture(scope="module")
def spawned():
    return per_world_spawner(LAYOUTS, _run)


@pytest.mark.distributed
@pytest.mark.parametrize("world,layout_kwargs", LAYOUTS, ids=["ep2", "tp2-ep2-esp2"])
def test_deferred_wgrad_equals_reference(world, layout_kwargs, spawned):
    layout = RankLayout(world_size=world, **layout_kwargs)
    outputs = spawned(world)[str(layout_kwargs)]
    for i, (schedule, saa, smart, index) in enumerate(RUNS):
        check_against_reference([out[i][0] for out in outputs], index, layout,
                                f"defer_wgrad {schedule} saa={saa} smart={smart}")
