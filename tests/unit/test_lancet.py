"""Lancet's weight-gradient scheduling (moe/lancet.py): the deferred linear and grouped GEMM give
autograd's gradients, and `WGradScheduler.fill` is Alg. 1's greedy (best match to the remaining
all-to-all time first, until it is covered), with the rest run when backward ends."""
import pytest
import torch
import torch.nn.functional as F

from megatron_moe.config import ConfigError, load_config, validate_config
from megatron_moe.moe.grouped_gemm import grouped_mm
from megatron_moe.moe.lancet import WGradScheduler, deferred_grouped_mm, deferred_linear
from megatron_moe.perf.alpha_beta import AlphaBeta


def test_deferred_linear_matches_autograd_and_defers_until_backward_ends():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, generator=gen, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(2, 4, 5, generator=gen))  # viewed [8, 5], as SwiGLU's fc1
    bias = torch.nn.Parameter(torch.randn(2, 4, generator=gen))
    upstream = torch.randn(2, 3, 8, generator=gen)
    scheduler = WGradScheduler()
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


@pytest.mark.parametrize("index", [None, [2, 0]])
def test_deferred_grouped_mm_matches_autograd_with_rows_and_scale(index):
    gen = torch.Generator().manual_seed(1)
    leaf = torch.nn.Parameter(torch.randn(3, 4, 2, 3, generator=gen))  # [slots, h, (2,) f] like SwiGLU's w1
    counts = [3, 0] if index else [2, 0, 3]
    x = torch.randn(sum(counts), 4, generator=gen, requires_grad=True)
    upstream = torch.randn(sum(counts), 6, generator=gen)
    rows = torch.tensor(index) if index else None
    y = deferred_grouped_mm(x, leaf, rows, 0.5, counts, WGradScheduler())
    (y * upstream).sum().backward()
    x_ref, leaf_ref = x.detach().clone().requires_grad_(True), leaf.detach().clone().requires_grad_(True)
    stack = leaf_ref if rows is None else leaf_ref.index_select(0, rows)
    y_ref = grouped_mm(x_ref, stack.reshape(len(counts), 4, 6), counts)
    (y_ref * upstream).sum().backward()
    torch.testing.assert_close(y.detach(), y_ref.detach())
    torch.testing.assert_close(x.grad, x_ref.grad)  # the scale is the weights' (redundancy correction)
    torch.testing.assert_close(leaf.grad, 0.5 * leaf_ref.grad)
    if rows is not None:
        assert float(leaf.grad[1].abs().sum()) == 0.0  # a slot that computed nothing


def test_fill_is_algorithm_1_greedy():
    """t_u = 10 (alpha-beta on the all-to-all's elements); queued dW of estimated 3, 9, 4, 20
    (FLOPs x 1 s/FLOP): best match to 10 is 9 (t_u 1), then 3 (|1 - 3| beats 4 and 20; t_u -2):
    covered. The others run when backward ends."""
    scheduler = WGradScheduler(seconds_per_flop=1.0, alltoall=AlphaBeta(alpha=0.0, beta=1.0))
    ran = []
    scheduler.pending = [(flops, (lambda f=flops: ran.append(f))) for flops in (3.0, 9.0, 4.0, 20.0)]
    scheduler._run = lambda flops, work: (work(), 0.0)[1]  # keep the estimates fixed (no timing)
    scheduler.fill(10)
    assert ran == [9.0, 3.0]
    scheduler.drain()
    assert ran == [9.0, 3.0, 4.0, 20.0] and not scheduler.pending


def test_fill_without_a_profile_runs_everything_queued():
    scheduler = WGradScheduler()
    ran = []
    scheduler.pending = [(1.0, lambda: ran.append(1)), (1e12, lambda: ran.append(2))]
    scheduler.fill(1)
    assert ran == [1, 2]


def test_seconds_per_flop_is_measured():
    scheduler = WGradScheduler(seconds_per_flop=1.0)
    scheduler.pending = [(1e9, lambda: None)]
    scheduler.drain()
    assert scheduler.seconds_per_flop < 0.8  # moved toward the (tiny) measured time


def test_defer_wgrad_with_bf16_is_refused():
    cfg = load_config("configs/gpt_moe_tiny.yaml", ["moe.lancet.defer_wgrad=true", "training.precision=bf16"])
    with pytest.raises(ConfigError, match="moe.lancet.defer_wgrad.*training.precision"):
        validate_config(cfg, 1)
