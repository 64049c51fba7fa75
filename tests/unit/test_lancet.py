"""Lancet's weight-gradient scheduling (techniques/lancet/lancet.py): the deferred linear and grouped GEMM give
autograd's gradients, and `WGradScheduler.fill` is Alg. 1's greedy (best match to the remaining
all-to-all time first, until it is covered), with the rest run when backward ends."""
import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron_moe.config import ConfigError, load_config, validate_config
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.precision import MainGrads
from megatron_moe.moe.grouped_gemm import grouped_mm, grouped_mm_into_grad
from megatron_moe.techniques.lancet.lancet import WGradScheduler, deferred_linear
from megatron_moe.techniques.lancet.lancet_partition import ForwardPartitioner
from megatron_moe.perf.alpha_beta import AlphaBeta
from megatron_moe.techniques.lancet.lancet_partition_model import (Instruction, MoECost, best_partitioning, fixed_partitioning,
                                                pipeline_time, segment_time)
from tests.lancet_times import measure_injected
from tests.tiny_model import assert_same_steps, tiny_model_steps

NO_A2A = AlphaBeta(0.0, 0.0)  # an all-to-all estimate of 0 s: `fill` runs nothing, backward's end everything


def test_deferred_linear_matches_autograd_and_defers_until_backward_ends():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, generator=gen, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(2, 4, 5, generator=gen))  # viewed [8, 5], as SwiGLU's fc1
    bias = torch.nn.Parameter(torch.randn(2, 4, generator=gen))
    upstream = torch.randn(2, 3, 8, generator=gen)
    scheduler = WGradScheduler(NO_A2A)
    seen = []
    y = deferred_linear(x, weight, bias, scheduler)
    z = y * upstream
    z.register_hook(lambda g: seen.append(weight.grad))  # during backward, before the dW ran
    z.sum().backward()
    assert seen == [None] and not scheduler.pending  # deferred, then run when backward ended
    x_ref, w_ref, b_ref = (t.detach().clone().requires_grad_(True) for t in (x, weight, bias))
    (F.linear(x_ref, w_ref.view(8, 5), b_ref.view(8)) * upstream).sum().backward()
    torch.testing.assert_close(y.detach(), F.linear(x.detach(), weight.detach().view(8, 5), bias.detach().view(8)))
    for got, want in ((x.grad, x_ref.grad), (weight.grad, w_ref.grad), (bias.grad, b_ref.grad)):
        torch.testing.assert_close(got, want)


def test_deferred_grouped_mm_matches_autograd_with_scale():
    gen = torch.Generator().manual_seed(1)
    leaf = torch.nn.Parameter(torch.randn(3, 4, 2, 3, generator=gen))  # [experts, h, (2,) f] like SwiGLU's w1
    counts = [2, 0, 3]
    x = torch.randn(sum(counts), 4, generator=gen, requires_grad=True)
    upstream = torch.randn(sum(counts), 6, generator=gen)
    scheduler, seen = WGradScheduler(NO_A2A), []
    y = grouped_mm_into_grad(x, leaf, 0.5, counts, scheduler)
    z = y * upstream
    z.register_hook(lambda g: seen.append(leaf.grad))  # during backward, before the dW ran
    z.sum().backward()
    assert seen == [None] and not scheduler.pending  # deferred, then run when backward ended
    x_ref, leaf_ref = x.detach().clone().requires_grad_(True), leaf.detach().clone().requires_grad_(True)
    y_ref = grouped_mm(x_ref, leaf_ref.reshape(len(counts), 4, 6), counts)
    (y_ref * upstream).sum().backward()
    torch.testing.assert_close(y.detach(), y_ref.detach())
    torch.testing.assert_close(x.grad, x_ref.grad)  # the scale is the weights' (redundancy correction)
    torch.testing.assert_close(leaf.grad, 0.5 * leaf_ref.grad)
    assert float(leaf.grad[1].abs().sum()) == 0.0  # an expert that computed nothing


def test_fill_is_algorithm_1_greedy():
    """t_u = 10 (alpha-beta on the all-to-all's elements); queued dW of estimated 3, 9, 4, 20
    (FLOPs x 1 s/FLOP), each for its own parameter: best match to 10 is 9 (t_u 1), then 3
    (|1 - 3| beats 4 and 20; t_u -2): covered. The others run when backward ends."""
    scheduler = WGradScheduler(AlphaBeta(alpha=0.0, beta=1.0), seconds_per_flop=1.0)
    ran = []
    scheduler.pending = [(flops, (lambda f=flops: ran.append(f)), (i,)) for i, flops in enumerate((3.0, 9.0, 4.0, 20.0))]
    scheduler._run = lambda flops, work: (work(), 0.0)[1]  # keep the estimates fixed (no timing)
    scheduler.fill(10)
    assert ran == [9.0, 3.0]
    scheduler.drain()
    assert ran == [9.0, 3.0, 4.0, 20.0] and not scheduler.pending


def test_fill_keeps_each_parameters_dw_in_queue_order():
    """Queued: a1 (20 s, parameter a), a2 (9 s, a), b (3 s, b); t_u = 10. The unconstrained greedy
    would run a2 (9) first, adding a's dW into `.grad` out of order, an order that then depends on
    the measured times. a2 is not ready while a1 waits: b (|10 - 3| < |10 - 20|), then a1."""
    scheduler = WGradScheduler(AlphaBeta(alpha=0.0, beta=1.0), seconds_per_flop=1.0)
    ran = []
    scheduler.pending = [(20.0, lambda: ran.append("a1"), (1,)), (9.0, lambda: ran.append("a2"), (1,)),
                         (3.0, lambda: ran.append("b"), (2,))]
    scheduler._run = lambda flops, work: (work(), 0.0)[1]
    scheduler.fill(10)
    assert ran == ["b", "a1"]
    scheduler.drain()
    assert ran == ["b", "a1", "a2"]


def test_gradients_do_not_depend_on_the_measured_times(one_thread):
    """Two weights used by 4 batch parts (Lancet's partitions): 8 deferred dW, 4 per weight, whose
    magnitudes span 1e-3..1e3 so that the order of the float additions into `.grad` shows. An
    all-to-all fills before each part's backward, with injected seconds-per-FLOP and all-to-all
    times that change which dW it runs; every run's gradients are bitwise those of the first."""
    import random

    gen = torch.Generator().manual_seed(5)
    w1, w2 = torch.nn.Parameter(torch.randn(24, 16, generator=gen)), torch.nn.Parameter(torch.randn(8, 24, generator=gen))
    # parts of different sizes (as the experts' rows per part): equal estimates would tie, and
    # ties go in queue order
    xs = [torch.randn(rows, 16, generator=gen) * 10.0 ** e for rows, e in ((32, -3), (20, 3), (45, 0), (8, 1))]
    ups = [torch.randn(x.shape[0], 8, generator=gen) for x in xs]

    def run(seed):
        rng, fills = random.Random(seed), []
        scheduler = WGradScheduler(NO_A2A)
        w1.grad = w2.grad = None

        def fill(_grad):  # an all-to-all in flight, as timed under some load
            scheduler.seconds_per_flop = 10.0 ** rng.uniform(-12, -8)
            scheduler.alltoall = AlphaBeta(0.0, 10.0 ** rng.uniform(-12, -7))
            before = [work for _, work, _ in scheduler.pending]
            scheduler.fill(1000)
            fills.append(tuple(before.index(work) for work in before if work not in
                               [w for _, w, _ in scheduler.pending]))

        loss = 0.0
        for x, up in zip(xs, ups):
            y = deferred_linear(deferred_linear(x, w1, None, scheduler), w2, None, scheduler)
            y.register_hook(fill)
            loss = loss + (y * up).sum()
        loss.backward()
        return w1.grad.clone(), w2.grad.clone(), fills

    first = run(0)
    schedules = {tuple(first[2])}
    for seed in range(1, 8):
        g1, g2, fills = run(seed)
        schedules.add(tuple(fills))
        assert torch.equal(g1, first[0]) and torch.equal(g2, first[1]), seed
    assert len(schedules) > 2  # the injected times did move dW between all-to-alls


def test_seconds_per_flop_is_measured():
    scheduler = WGradScheduler(NO_A2A, seconds_per_flop=1.0)
    scheduler.pending = [(1e9, lambda: None, (0,))]
    scheduler.drain()
    assert scheduler.seconds_per_flop < 0.8  # moved toward the (tiny) measured time


def test_deferred_wgrad_in_bf16_goes_into_the_fp32_main_grad():
    """bf16 parameters with fp32 main gradients (model/precision.py): the deferred dW of a linear
    and of a grouped GEMM land in `main_grad`, added to what was there (gradient accumulation),
    and nothing stays in the bf16 `.grad`. Reference: the same bf16 values in fp32; the bf16 GEMM
    rounds its product once (unit roundoff 2^-8 = 3.9e-3 relative), hence rtol 1e-2."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.nn.Parameter(torch.randn(6, 5, generator=gen).bfloat16())
    leaf = torch.nn.Parameter(torch.randn(2, 6, 3, generator=gen).bfloat16())
    MainGrads([weight, leaf])
    weight.main_grad.fill_(1.0)  # an earlier micro-batch's gradient
    x = torch.randn(7, 5, generator=gen).bfloat16()
    up = torch.randn(7, 3, generator=gen).bfloat16()
    scheduler = WGradScheduler(NO_A2A)
    y = grouped_mm_into_grad(deferred_linear(x, weight, None, scheduler), leaf, 0.5, [4, 3], scheduler)
    (y.float() * up.float()).sum().backward()
    assert weight.grad is None and leaf.grad is None and not scheduler.pending
    w32, l32 = weight.detach().float().requires_grad_(True), leaf.detach().float().requires_grad_(True)
    h = F.linear(x.float(), w32).bfloat16().float()  # the bf16 run's activation, rounded
    loss = (torch.cat([h[:4] @ l32[0], h[4:] @ l32[1]]) * up.float()).sum()
    gw, gl = torch.autograd.grad(loss, [w32, l32])
    assert weight.main_grad.dtype == leaf.main_grad.dtype == torch.float32
    torch.testing.assert_close(weight.main_grad, 1.0 + gw, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(leaf.main_grad, 0.5 * gl, rtol=1e-2, atol=1e-2)


# -- §5: the partitioned forward (techniques/lancet/lancet_partition.py, techniques/lancet/lancet_partition_model.py) -------------

def _instructions(rng, n_ops, max_parts, moe_every):
    """Random sublayer times; every `moe_every`-th op is an MoE FFN with random all-to-alls."""
    ops = []
    for i in range(n_ops):
        base = {k: float(rng.uniform(0.5, 2.0)) / k + float(rng.uniform(0, 0.3)) for k in range(1, max_parts + 1)}
        if i % moe_every == moe_every - 1:
            comm = float(rng.uniform(0.5, 4.0))
            moe = {k: MoECost(base[k], comm / k + 0.05 * k, comm / k + 0.05 * k) for k in base}
            ops.append(Instruction(f"moe{i}", base, moe))
        else:
            ops.append(Instruction(f"op{i}", base))
    return ops


def _brute_force(ops, max_parts):
    """min over every split of the ops into contiguous segments and every k per segment."""
    n, best = len(ops), math.inf
    for cuts in itertools.product([False, True], repeat=n - 1):
        bounds = [0] + [i + 1 for i, cut in enumerate(cuts) if cut] + [n]
        total = 0.0
        for start, end in zip(bounds, bounds[1:]):
            total += min(segment_time(ops, start, end, k) for k in range(1, max_parts + 1))
        best = min(best, total)
    return best


def test_partition_dynamic_program_matches_brute_force():
    rng = np.random.default_rng(0)
    partitioned = 0
    for case in range(60):
        ops = _instructions(rng, n_ops=int(rng.integers(2, 9)), max_parts=4, moe_every=int(rng.integers(2, 4)))
        predicted, segments = best_partitioning(ops, 4)
        assert predicted == pytest.approx(_brute_force(ops, 4), rel=1e-12), case
        # the segments reproduce the prediction: partitioned ones as P(i, n, k), the rest plain
        covered = sum(segment_time(ops, s.start, s.end, s.parts) for s in segments)
        plain = sum(op.total(1) for i, op in enumerate(ops) if not any(s.start <= i < s.end for s in segments))
        assert covered + plain == pytest.approx(predicted, rel=1e-12)
        assert all(sum(ops[i].moe is not None for i in range(s.start, s.end)) == 1 for s in segments)
        partitioned += bool(segments)
    assert partitioned > 10  # the cases exercise partitioning, not only the plain sum


def test_pipeline_time_overlaps_all_to_alls_with_the_other_parts():
    moe = MoECost(compute=1.0, dispatch=2.0, combine=2.0)
    assert pipeline_time(1, 3.0, moe, 3.0) == 3 + 2 + 1 + 2 + 3  # one part: nothing overlaps
    # two parts of half the work: D_0 runs under A_1 and C_1 under B_0; C_0 and D_1 stay exposed:
    # A0 3 | D0 (A1 3) | X0 1 | C0 2 | D1 2 | X1 1 | C1 (B0 3) | B1 3 = 18, vs 22 unpartitioned
    assert pipeline_time(2, 3.0, moe, 3.0) == 18.0
    assert pipeline_time(1, 6.0, MoECost(2.0, 4.0, 4.0), 6.0) == 22.0
    # segments: no MoE FFN or two of them cannot be partitioned
    ops = [Instruction("a", {1: 1.0, 2: 0.6}), Instruction("b", {1: 1.0, 2: 0.6})]
    assert segment_time(ops, 0, 2, 2) == math.inf and segment_time(ops, 0, 2, 1) == 2.0


def test_fixed_partition_ranges_do_not_overlap():
    is_moe = [False, True] * 3  # a0 F0 a1 F1 a2 F2 (layer_freq 1)
    assert [(s.start, s.end) for s in fixed_partitioning(is_moe, 2, 0)] == [(1, 2), (3, 4), (5, 6)]
    assert [(s.start, s.end) for s in fixed_partitioning(is_moe, 2, 1)] == [(0, 3), (3, 5), (5, 6)]
    is_moe = [False, False, False, True] * 2  # a0 d0 a1 F1 a2 d2 a3 F3 (layer_freq 2)
    assert [(s.start, s.end, s.moe) for s in fixed_partitioning(is_moe, 4, 2)] == [(1, 6, 3), (6, 8, 7)]


@pytest.fixture
def planned(monkeypatch):
    """Inject op times into `auto` (tests/lancet_times.py) and record every plan it makes."""
    plans = []
    plan = ForwardPartitioner.plan

    def recording(self, *args):
        plans.append(plan(self, *args))
        return plans[-1]

    monkeypatch.setattr(ForwardPartitioner, "measure", measure_injected)
    monkeypatch.setattr(ForwardPartitioner, "plan", recording)
    return plans


@pytest.mark.parametrize("bert", [False, True], ids=["gpt", "bert"])
def test_partitioned_forward_is_exact_with_dropout_and_drops(bert, planned, one_thread):
    plain = tiny_model_steps([], bert)
    assert sum(plain[0].dropped) > 0
    for parts, reach, defer in [(2, "1", False), (4, "0", True), (3, "3", False), (4, "auto", False)]:
        got = tiny_model_steps([f"moe.lancet.partitions={parts}", f"moe.lancet.partition_range={reach}",
                                f"moe.lancet.defer_wgrad={str(defer).lower()}"], bert)
        assert_same_steps(got, plain, f"partitions={parts} range={reach} defer_wgrad={defer}")
    # auto (injected times) partitioned each layer's [attention, MoE FFN] into 4 parts: not plain vs plain
    assert [[(s.start, s.end, s.parts) for s in segments] for segments in planned] == [[(0, 2, 4), (2, 4, 4)]]


@pytest.mark.parametrize("max_range,segments", [(None, [(0, 2), (2, 4)]), (1, []), (3, [(0, 3)]), (10, [(0, 3)])])
def test_max_range_bounds_the_auto_search(max_range, segments, planned, one_thread):
    """§5.1's iota reaches the dynamic program: by default 2 x layer_freq = 2 sublayers (one
    pipeline per MoE layer), 1 = the MoE FFN alone (no overlap: nothing pays), 3 and more lets
    [attention 0, MoE 0, attention 1] form one pipeline, the best unbounded pick."""
    from megatron_moe.model.gpt import GPTMoEModel

    overrides = ["model.seq_length=12", "training.micro_batch_size=4", "moe.lancet.partitions=4"]
    cfg = load_config("configs/gpt_moe_tiny.yaml", overrides + ([f"moe.lancet.max_range={max_range}"]
                                                                if max_range is not None else []))
    validate_config(cfg, 1)
    model = GPTMoEModel(cfg, ParallelState.single_process())
    model(torch.zeros(4, 12, dtype=torch.long), torch.zeros(4, 12, dtype=torch.long))
    assert model.partitioners[0].max_range == (max_range or 2)
    assert [(s.start, s.end) for s in planned[0]] == segments


@pytest.mark.parametrize("overrides,match", [
    (["moe.lancet.partitions=3", "training.micro_batch_size=2"], "partitions=3 must be <= training.micro_batch_size"),
    (["moe.lancet.partitions=0"], "partitions=0 must be >= 1"),
    (["moe.lancet.partitions=2", "moe.lancet.partition_range=all"], "partition_range='all' must be auto"),
    (["moe.lancet.partitions=2", "moe.gate=topology"], "moe.lancet.partitions>1 and moe.gate=topology"),
    (["moe.lancet.partitions=2", "moe.lancet.max_range=0"], "max_range=0 must be >= 1"),
    (["moe.lancet.partitions=2", "moe.lancet.partition_range=1", "moe.lancet.max_range=2"],
     "max_range=2 .* needs moe.lancet.partition_range=auto"),
])
def test_partition_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate_config(load_config("configs/gpt_moe_tiny.yaml", overrides), 1)


def test_op_profiling_leaves_the_communication_counters_alone():
    """`auto`'s measurement pass runs under `CommStats.unrecorded`: what it sends is not part of
    the iteration's bytes and times."""
    from types import SimpleNamespace

    from megatron_moe.distributed.collectives import CommStats

    stats = CommStats()
    group = SimpleNamespace(name="ep")
    stats.record("all_to_all", group, 100, 0.5)
    with stats.unrecorded():
        stats.record("all_to_all", group, 7, 0.25)
        stats.record("lancet_plan", group, 8, 0.1)
        assert stats.bytes_by_kind() == {"all_to_all": 107, "lancet_plan": 8}
    assert stats.bytes_by_kind() == {"all_to_all": 100} and stats.calls == {"all_to_all/ep": 1}
    assert stats.seconds_by_phase(["all_to_all"])["total"]["forward"] == 0.5
