"""Lancet == the single-process reference, dropless and with capacity drops.

1. Deferred weight gradients (techniques/lancet/lancet.py, `moe.lancet.defer_wgrad`) under every schedule, at
   the MoE layer: the experts' w1 / w2 gradients are computed while the backward all-to-alls are in
   flight (or at the end of backward) and must equal the plain run's.
2. The partitioned forward (techniques/lancet/lancet_partition.py, `moe.lancet.partitions` 2 and 4, with and
   without `defer_wgrad`), on the whole GPT-MoE model through the trainer: loss, aux loss, grad
   norm and every synced gradient equal one process running the unpartitioned model.
3. `defer_wgrad` without `perf.hardware_profile` (a GPTMoEModel built directly): calibration gives
   Alg. 1 a finite all-to-all budget, so the dW spread over the backward all-to-alls.

On gloo, and on NCCL with a GPU per rank (`make test-gpu`; the reference stays one CPU process).
"""
import pytest
import torch

from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.parallel_state import ParallelState, RankLayout
from tests.distributed.harness import BACKENDS, per_world_spawner
from tests.distributed.moe_cases import check_against_reference, run_on_layouts
from tests.distributed.test_grads import _model_config, _trainer_grads
from tests.distributed.test_moe_parm import TESTBED_B

LAYOUTS = [(2, dict(expert=2)), (4, dict(tensor=2, expert=2, expert_shard=2))]
RUNS = [  # (schedule, saa, smart schedule, case)
    ("baseline", False, False, 0), ("baseline", False, False, 1), ("s1", False, False, 2), ("s2", True, False, 1),
    ("auto", True, False, 0), ("s2", False, True, 3),
    ("s2", True, False, 4), ("baseline", False, False, 5),  # router variants + shared experts (moe_cases.VARIANTS)
]


# (layout index, partitions, partition_range, defer_wgrad, capacity_factor, schedule, saa)
PARTITION_RUNS = [
    (0, 2, "1", False, None, "baseline", False), (0, 4, "2", True, 1.0, "baseline", False),
    (0, 4, "0", False, 1.0, "baseline", False), (0, 2, "3", True, None, "baseline", False),
    (1, 2, "1", False, None, "s2", True), (1, 4, "2", True, 1.0, "s2", True),
    (1, 2, "0", False, 1.0, "s1", False), (1, 4, "1", False, 1.0, "auto", True),
]


def _partition_config(layout, run, reference=False):
    """The tiny GPT-MoE of test_grads with 4-sequence micro-batches (so 4 parts fit) and `run`'s
    keys; `reference`: the same model unpartitioned, baseline schedule."""
    _, parts, reach, defer, capacity, schedule, saa = run
    cfg = _model_config(layout)
    cfg.training.micro_batch_size, cfg.moe.capacity_factor = 4, capacity
    if not reference:
        cfg.moe.schedule, cfg.moe.saa, cfg.perf.hardware_profile = schedule, saa, TESTBED_B
        cfg.moe.lancet.partitions, cfg.moe.lancet.partition_range, cfg.moe.lancet.defer_wgrad = parts, reach, defer
    return cfg


def _partitioned(state, layout):
    """This rank's trainer results for every PARTITION_RUNS item on `layout`."""
    out = []
    for run in PARTITION_RUNS:
        if LAYOUTS[run[0]][1] != layout:
            continue
        sub = ParallelState.build(RankLayout(world_size=state.world_size, **layout), state.rank)
        C.COMM_STATS.reset()
        out.append(_trainer_grads(_partition_config(layout, run), sub) + (C.COMM_STATS.seconds_by_phase(
            ("all_to_all", "all_to_all_p2p"))["total"]["forward"],))
    return out


def _run(state, jobs, cache):
    def setup(run):
        schedule, saa, smart, index = run

        def edit(cfg, sub):
            cfg.moe.schedule, cfg.moe.saa, cfg.perf.hardware_profile = schedule, saa, TESTBED_B
            cfg.moe.smart_schedule = smart
            cfg.moe.lancet.defer_wgrad = True
            return None

        return index, edit

    layers = run_on_layouts(state, jobs, RUNS, setup)
    return [(layer, _partitioned(state, layout), _calibrated_budget(state, layout, cache))
            for layer, layout in zip(layers, jobs)]


def _stub_points(state, *args, **kwargs):
    """Start-up calibration's timings, stubbed: every collective 1 ns at any size (so any dW
    covers an all-to-all's estimate), the experts 1e-10 s per FLOP."""
    groups = {"mp_allgather": state.tp, "ep_esp_alltoall": state.ep_esp, "saa": state.ep_esp, "p2p": state.ep,
              "broadcast": state.ep}
    points = {op: ([1e3, 1e6], [1e-9, 1e-9]) if group.size > 1 else ([], []) for op, group in groups.items()}
    return {**points, "expert_compute": ([1e6, 1e9], [1e-4, 1e-1])}


def _calibrated_budget(state, layout, cache):
    """`defer_wgrad` without `perf.hardware_profile`, built as a library user does (GPTMoEModel):
    start-up calibration (timings stubbed) gives Alg. 1 a finite all-to-all budget. -> (the
    scheduler's all-to-all estimate, dW run by each backward fill, dW time left for the end)."""
    from megatron_moe.model.gpt import GPTMoEModel
    from megatron_moe.training import calibrate

    sub = ParallelState.build(RankLayout(world_size=state.world_size, **layout), state.rank)
    cfg = _model_config(layout, ["moe.lancet.defer_wgrad=true", f"perf.calibration_cache={cache}"])
    measure, calibrate.measure_points = calibrate.measure_points, _stub_points
    try:
        model = GPTMoEModel(cfg, sub)
    finally:
        calibrate.measure_points = measure
    scheduler = next(m.wgrad for m in model.modules() if getattr(m, "wgrad", None) is not None)
    fill, counts = scheduler.fill, []

    def counting(elements):
        before = len(scheduler.pending)
        fill(elements)
        counts.append(before - len(scheduler.pending))

    scheduler.fill = counting
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(sub.dp.rank))
    out = model(tokens, tokens)
    (out.lm_loss + out.aux_loss).backward()
    return scheduler.alltoall, counts, scheduler.drained_seconds


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    return per_world_spawner(LAYOUTS, _run, args=(str(tmp_path_factory.mktemp("calibration")),))


@pytest.mark.distributed
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world,layout_kwargs", LAYOUTS, ids=["ep2", "tp2-ep2-esp2"])
def test_deferred_wgrad_equals_reference(world, layout_kwargs, backend, spawned):
    layout = RankLayout(world_size=world, **layout_kwargs)
    outputs = [layer for layer, _, _ in spawned(world, backend)[str(layout_kwargs)]]
    for i, (schedule, saa, smart, index) in enumerate(RUNS):
        check_against_reference([out[i][0] for out in outputs], index, layout,
                                f"defer_wgrad {schedule} saa={saa} smart={smart}")


@pytest.mark.distributed
@pytest.mark.parametrize("world,layout_kwargs", LAYOUTS, ids=["ep2", "tp2-ep2-esp2"])
def test_deferred_wgrad_without_a_profile_has_a_finite_budget(world, layout_kwargs, spawned):
    """Review issue #27 item 4: without a profile, start-up calibration is asked for the all-to-all
    estimate, so the dW spread over the backward all-to-alls by Alg. 1's budget (here each covers
    one dW) instead of all going into the first one."""
    for rank, (_, _, (alltoall, counts, drained)) in enumerate(spawned(world)[str(layout_kwargs)]):
        assert alltoall is not None and alltoall.time(1e6) == pytest.approx(1e-9, rel=1e-3), rank
        assert counts and max(counts) == 1 and counts.count(1) >= 2, (rank, counts)
        assert float(drained) > 0, rank  # the rest ran when backward ended


@pytest.mark.distributed
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world,layout_kwargs", LAYOUTS, ids=["ep2", "tp2-ep2-esp2"])
def test_partitioned_forward_equals_unpartitioned_single_process(world, layout_kwargs, backend, spawned):
    runs = [run for run in PARTITION_RUNS if LAYOUTS[run[0]][1] == layout_kwargs]
    per_rank = [model for _, model, _ in spawned(world, backend)[str(layout_kwargs)]]  # [rank][run]
    references = {}
    for i, run in enumerate(runs):
        capacity = run[4]
        if capacity not in references:
            references[capacity] = _trainer_grads(_partition_config({}, run, reference=True),
                                                  ParallelState.single_process())
        ref_loss, ref_aux, ref_norm, ref_grads = references[capacity]
        for rank, results in enumerate(per_rank):
            loss, aux, norm, grads, a2a_seconds = results[i]
            where = f"{run} rank {rank}"
            assert loss == pytest.approx(ref_loss, rel=1e-5), where
            assert aux == pytest.approx(ref_aux, rel=1e-4, abs=1e-7), where
            assert norm == pytest.approx(ref_norm, rel=1e-4), where
            assert a2a_seconds > 0, where  # the parts' all-to-alls ran
            for name, (slices, grad) in grads.items():
                torch.testing.assert_close(torch.from_numpy(grad), torch.from_numpy(ref_grads[name][1][slices]),
                                           rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{where} {name}: {m}")
