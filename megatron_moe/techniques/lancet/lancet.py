"""Lancet's weight-gradient scheduling (Jiang et al., MLSys'24, §4, Alg. 1), in eager PyTorch
(`moe.lancet.defer_wgrad: true`).

Lancet is a compiler pass: it finds, for every all-to-all of the backward pass, the weight-gradient
(dW) computations that have no path to or from it, and reorders them right after the all-to-all's
launch so they run while it is in flight. Here autograd is the graph and the pass is online:

* every linear layer of the model (`tensor_parallel/layers.py`: attention, dense MLP, output) and
  the experts' two grouped GEMMs (`moe/grouped_gemm.py` `grouped_mm_into_grad`) compute dX in
  backward as usual but hand their dW (and bias gradient) to the model's `WGradScheduler` as a
  closure (`defer`) instead of computing it. A dW
  depends on nothing that comes later in backward, and nothing in backward depends on it (it only
  ends in `.grad`): it is independent of every all-to-all still to come, Alg. 1's W^{I_i};
* the MoE schedules launch each backward all-to-all asynchronously and call `fill(elements)`
  while it is in flight: Alg. 1 lines 14-22, greedily run the queued dW whose estimated time best
  matches the all-to-all's remaining (unoverlapped) time, until it is covered or the queue is
  empty;
* whatever is still queued runs when the backward pass ends (autograd's `queue_callback`), so every
  `.grad` is complete before the optimizer sees it. dW is the same matmul autograd would run, so
  the gradients are those of the plain run up to the order of the float additions into `.grad`.

That order never depends on timing: `fill` chooses only among *ready* dW, those whose parameters
have no earlier-queued dW still waiting, so the dW of one parameter (one per batch part with
`moe.lancet.partitions`, one per pairwise step of the smart schedule) are added to its `.grad` in
the order backward queued them, which is program order. Measured times decide which all-to-all
hides a dW, never the result: two runs of one config give bitwise-identical gradients whatever
the load (`tests/distributed/test_reproducible.py`).

Times (Alg. 1's GetInstrExecTime): a dW's is its FLOPs x the seconds per FLOP measured on the dW
work already run (an exponential moving average, seeded by the hardware profile's
`expert_compute.beta`; each dW is timed on its device by `perf/timing.py`, CUDA events that enter
the average once they have fired, so backward never waits for the GPU to learn a time); an
all-to-all's comes from the profile's `ep_esp_alltoall` alpha-beta on its elements. The profile is
`perf.hardware_profile` or, unset, the one calibrated at start-up (`training/calibrate.py`:
`profile_needs` asks for the all-to-all's estimate), so the budget is finite.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from megatron_moe.model.precision import accumulate_wgrad_, grad_buffer
from megatron_moe.perf import timing
from megatron_moe.perf.alpha_beta import AlphaBeta
from megatron_moe.perf.hardware import LANCET_OPS, configured_profile
from megatron_moe.perf.timing import Duration
from megatron_moe.model.pipeline_stages import STAGE_HOOKS
from megatron_moe.perf.hardware import PROFILE_NEEDS

_SMOOTHING = 0.3  # weight of the newest measurement in the seconds-per-FLOP average


class WGradScheduler:
    """The dW work of one model's backward passes, deferred and run while all-to-alls are in flight;
    `alltoall`: alpha-beta seconds of a backward all-to-all on its elements (Alg. 1's budget)."""

    def __init__(self, alltoall: AlphaBeta, seconds_per_flop: float = 1e-10):
        self.seconds_per_flop = seconds_per_flop
        self.alltoall = alltoall
        # (FLOPs, closure, ids of the parameters whose .grad it adds to), in the order backward queued them
        self.pending: List[Tuple[float, Callable[[], None], Tuple[int, ...]]] = []
        self._callback_queued = False
        self.overlapped_seconds = Duration()  # dW time run inside all-to-alls (`float()` reads it)
        self.drained_seconds = Duration()  # dW time run at the end of backward
        self.anchor: Optional[torch.Tensor] = None  # a parameter of the model (`attach`): the dW's device
        self._measured: List[Tuple[float, Duration]] = []  # (FLOPs, time) not yet in the average

    def defer(self, flops: float, work: Callable[[], None], params: Sequence[torch.Tensor]) -> None:
        """Queue one dW computation (called from a backward function) that adds to `params`' `.grad`."""
        self.pending.append((float(flops), work, tuple(id(p) for p in params)))
        if not self._callback_queued:  # run what is left when this backward pass ends
            torch.autograd.Variable._execution_engine.queue_callback(self.drain)
            self._callback_queued = True

    def fill(self, elements: int) -> None:
        """Alg. 1 lines 14-22 for an all-to-all of `elements` now in flight, over the ready dW."""
        budget = self.alltoall.time(elements)
        while budget > 0 and self.pending:
            estimates = {i: self.pending[i][0] * self.seconds_per_flop for i in self._ready()}
            j = min(estimates, key=lambda i: abs(budget - estimates[i]))
            flops, work, _ = self.pending.pop(j)
            self.overlapped_seconds += self._run(flops, work)
            budget -= estimates[j]  # t_u <- t_u - t^W_j

    def _ready(self) -> List[int]:
        """Indices of the queued dW that share no parameter with an earlier-queued one: running
        only these keeps every parameter's additions in queue order (module docstring)."""
        seen, ready = set(), []
        for i, (_, _, params) in enumerate(self.pending):
            if seen.isdisjoint(params):
                ready.append(i)
            seen.update(params)
        return ready

    def drain(self) -> None:
        """Run every queued dW, in queue order (end of the backward pass)."""
        while self.pending:
            flops, work, _ = self.pending.pop(0)
            self.drained_seconds += self._run(flops, work)
        self._callback_queued = False

    def _run(self, flops: float, work: Callable[[], None]) -> Duration:
        with timing.span(self.anchor.device if self.anchor is not None else None) as span:
            work()
        if flops > 0:
            self._measured.append((flops, span.duration))
        while self._measured and self._measured[0][1].ready():  # CPU: this one; CUDA: those that have run
            flops, duration = self._measured.pop(0)
            self.seconds_per_flop += _SMOOTHING * (float(duration) / flops - self.seconds_per_flop)
        return span.duration

    def linear(self, x: torch.Tensor, weight: torch.nn.Parameter, bias: Optional[torch.nn.Parameter]) -> torch.Tensor:
        """`deferred_linear` with this scheduler (what tensor_parallel/layers.py calls on its `wgrad`)."""
        return deferred_linear(x, weight, bias, self)


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor, index: Optional[torch.Tensor] = None) -> None:
    """param's gradient (fp32 `main_grad` in bf16 runs, else `.grad`, created as autograd would)
    += grad (rows `index` of it when given)."""
    buffer = grad_buffer(param)
    if index is None:
        buffer.add_(grad.view_as(buffer))
    else:
        buffer.index_add_(0, index, grad.to(buffer.dtype))


class _DeferredLinear(torch.autograd.Function):
    """y = x W^T + b; backward: dX now, dW and db deferred (`WGradScheduler.defer`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, scheduler, shape):
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias, ctx.scheduler, ctx.shape = weight, bias, scheduler, shape
        return F.linear(x, weight.detach().view(shape), None if bias is None else bias.detach().view(-1))

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        weight, bias = ctx.weight, ctx.bias
        dx = grad.matmul(weight.detach().view(ctx.shape))
        rows, dy = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])

        def dw():  # straight into the fp32 main gradient in bf16 runs (model/precision.py)
            accumulate_wgrad_(grad_buffer(weight).view(-1, rows.shape[1]), dy.t(), rows)
            if bias is not None:
                accumulate_grad(bias, dy.sum(0))

        ctx.scheduler.defer(2.0 * rows.shape[0] * rows.shape[1] * dy.shape[1], dw,
                            (weight,) if bias is None else (weight, bias))
        return dx, None, None, None, None


def deferred_linear(x: torch.Tensor, weight: torch.nn.Parameter, bias: Optional[torch.nn.Parameter],
                    scheduler: WGradScheduler) -> torch.Tensor:
    """F.linear(x, weight viewed [out, in], bias viewed [out]) with dW deferred; weight and bias
    must be leaf parameters (their gradients are written into `.grad` by the deferred work)."""
    return _DeferredLinear.apply(x, weight, bias, scheduler, (-1, weight.shape[-1]))


def attach(model: torch.nn.Module, scheduler: WGradScheduler) -> None:
    """Give every layer that defers dW, and every MoE schedule that fills its backward all-to-alls,
    the model's scheduler (`moe.lancet.defer_wgrad`)."""
    from megatron_moe.moe.experts import Experts
    from megatron_moe.moe.schedules.base import Schedule
    from megatron_moe.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    scheduler.anchor = next(model.parameters(), None)  # moves with `model.to(device)`
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, Experts)):
            module.wgrad = scheduler
    for module in model.modules():
        schedule = getattr(module, "schedule", None)
        if isinstance(schedule, Schedule):
            schedule.wgrad = scheduler


@STAGE_HOOKS.register("moe.lancet.defer_wgrad")
def attach_from_config(model: torch.nn.Module, cfg) -> Optional[WGradScheduler]:
    """`attach` a scheduler built from `cfg` when `moe.lancet.defer_wgrad` is on; returns it."""
    scheduler = build_scheduler(cfg)
    if scheduler is not None:
        attach(model, scheduler)
    return scheduler


def build_scheduler(cfg) -> Optional[WGradScheduler]:
    """The model's `WGradScheduler` when `moe.lancet.defer_wgrad` is on, else None: the all-to-all
    budget and the first dW estimate from `perf.hardware_profile` (the models calibrate one at
    start-up when it is unset; `perf/hardware.py` `configured_profile`)."""
    if not cfg.moe.lancet.defer_wgrad:
        return None
    profile = configured_profile(cfg, LANCET_OPS, "moe.lancet.defer_wgrad=true")
    compute = profile.expert_compute
    return WGradScheduler(profile.ep_esp_alltoall,
                          seconds_per_flop=compute.beta if compute is not None and compute.beta > 0 else 1e-10)


@PROFILE_NEEDS.register("lancet")
def _profile_needs(cfg) -> list:
    # Alg. 1's budget: each backward all-to-all's estimated time
    return [(LANCET_OPS, "moe.lancet.defer_wgrad=true")] if cfg.moe.lancet.defer_wgrad else []
