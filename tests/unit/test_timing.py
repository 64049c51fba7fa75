"""perf/timing.py's CUDA path, on a stub device API (issue #27): `FakeGPU` simulates streams that
run their work in order, each with its own clock, while the host runs ahead, and logs every call
in the order the GPU sees it. It refuses, as CUDA does, to read the time between events that have
not fired. The tests check that the events wrap the right work on the right stream, that nothing
waits for the GPU until a time is read, and that the times read are the GPU's, not the host's."""
from contextlib import contextmanager

import pytest
import torch

from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.parallel_state import Group
from megatron_moe.techniques.lancet.lancet import WGradScheduler
from megatron_moe.perf import timing
from megatron_moe.perf.alpha_beta import AlphaBeta
from megatron_moe.perf.timing import DeviceClock, Duration
from megatron_moe.training.metrics import PhaseTimer

CUDA = torch.device("cuda")


class Stream:
    def __init__(self, name: str):
        self.name, self.time = name, 0.0  # ms: when the work queued on it so far ends


class Event:
    def __init__(self, number: int, stream: Stream):
        self.number, self.stream, self.time, self.fired = number, stream, stream.time, False


class FakeWork:
    """An NCCL collective in flight: `wait()` makes the current stream wait for its end."""

    def __init__(self, gpu: "FakeGPU", end: float):
        self.gpu, self.end = gpu, end

    def wait(self) -> None:
        stream = self.gpu.current
        stream.time = max(stream.time, self.end)
        self.gpu.log.append(("wait", stream.name))


class FakeGPU:
    """`timing.CudaEvents`' methods over a simulated GPU (times in ms)."""

    def __init__(self):
        self.compute, self.nccl, self.completion = Stream("compute"), Stream("nccl"), Stream("completion")
        self.current = self.compute
        self.log, self.events = [], []

    # -- the device API -----------------------------------------------------------------------
    def current_stream(self):
        return self.current

    def completion_stream(self):
        return self.completion

    @contextmanager
    def on(self, stream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def record(self, stream):
        event = Event(len(self.events), stream)
        self.events.append(event)
        self.log.append(("record", event.number, stream.name))
        return event

    def query(self, event) -> bool:
        self.log.append(("query", event.number))
        return event.fired

    def synchronize(self, event) -> None:
        self.log.append(("synchronize", event.number))
        self._run_until(event.time)

    def elapsed_ms(self, start, end) -> float:
        if not (start.fired and end.fired):
            raise RuntimeError("elapsed_time of an event that has not completed")
        self.log.append(("elapsed", start.number, end.number))
        return end.time - start.time

    def synchronize_device(self) -> None:
        self.log.append(("synchronize_device",))
        self._run_until(float("inf"))

    # -- the work ------------------------------------------------------------------------------
    def kernel(self, ms: float) -> None:
        self.current.time += ms
        self.log.append(("kernel", self.current.name, ms))

    def collective(self, ms: float) -> FakeWork:
        """Launched on the NCCL stream after the current stream's work so far (as NCCL orders it)."""
        start = max(self.nccl.time, self.current.time)
        self.nccl.time = start + ms
        self.log.append(("launch", "nccl", ms))
        return FakeWork(self, self.nccl.time)

    def catch_up(self) -> None:
        """The GPU runs everything queued, without the host waiting (later `query`s see it)."""
        self._run_until(float("inf"))

    def _run_until(self, t: float) -> None:
        for event in self.events:
            event.fired |= event.time <= t

    def reads(self):
        return [entry for entry in self.log if entry[0] in ("query", "synchronize", "elapsed", "synchronize_device")]


@pytest.fixture
def gpu():
    fake = FakeGPU()
    with timing.override(DeviceClock(fake)):
        C.COMM_STATS.reset()
        yield fake
    C.COMM_STATS.reset()


EP = Group("ep", [0, 1], 0)


def test_span_events_wrap_the_work_on_its_stream_and_are_read_lazily(gpu):
    with timing.span(CUDA) as span:
        gpu.kernel(3.0)
    assert gpu.log == [("record", 0, "compute"), ("kernel", "compute", 3.0), ("record", 1, "compute")]
    assert float(span.duration) == pytest.approx(3e-3)
    # read only when asked for: has it ended? no: wait for both events, then read
    assert gpu.log[3:] == [("query", 1), ("synchronize", 0), ("synchronize", 1), ("elapsed", 0, 1)]


@pytest.mark.parametrize("compute_ms,exposed_ms", [(5.0, 3.0), (10.0, 0.0)])
def test_async_collective_exposed_is_the_compute_streams_wait_and_total_its_completion(gpu, compute_ms, exposed_ms):
    """An 8 ms all-to-all issued, `compute_ms` of compute queued while it is in flight, then waited
    for: exposed = how long the compute stream stood still (8 - 5 = 3 ms, or 0 when the compute
    covers it); total = issue to the collective's end (8 ms, even when the compute stream gets to
    the wait later: the completion stream's event fires when the collective ends)."""
    pending = C._issue("all_to_all", EP, 64, lambda: [gpu.collective(8.0)], CUDA)
    gpu.kernel(compute_ms)
    pending.wait()
    gpu.kernel(1.0)
    assert gpu.log == [
        ("record", 0, "compute"), ("launch", "nccl", 8.0), ("record", 1, "compute"),  # issue
        ("kernel", "compute", compute_ms),  # the work queued while it is in flight
        ("record", 2, "compute"), ("wait", "compute"), ("record", 3, "compute"),  # the compute stream waits
        ("wait", "completion"), ("record", 4, "completion"),  # completion, off the compute stream
        ("kernel", "compute", 1.0),
    ]  # and nothing waited for the GPU (no query, synchronize or elapsed)
    times = C.COMM_STATS.seconds_by_kind()
    assert times["exposed"]["all_to_all"] == pytest.approx(exposed_ms * 1e-3)
    assert times["total"]["all_to_all"] == pytest.approx(8e-3)
    assert ("elapsed", 0, 4) in gpu.reads() and ("elapsed", 2, 3) in gpu.reads()
    assert C.COMM_STATS.bytes["all_to_all/ep"] == 64


def test_async_collective_into_a_time_sink_stays_lazy_until_read(gpu):
    sink = C.TimeSink()
    pending = C._issue("trans", EP, 8, lambda: [gpu.collective(2.0)], CUDA, sink=sink)
    gpu.kernel(0.5)
    pending.wait()
    exposed, total = sink["trans"]
    assert gpu.reads() == [] and not exposed.ready()
    assert (float(exposed), float(total)) == pytest.approx((1.5e-3, 2e-3))


def test_synchronous_collective_is_timed_on_the_compute_stream(gpu):
    gpu.kernel(4.0)  # earlier work: the collective starts after it
    with C._timed("all_reduce", EP, 16, device=CUDA):
        gpu.collective(2.0).wait()
    assert gpu.log[1:] == [("record", 0, "compute"), ("launch", "nccl", 2.0), ("wait", "compute"),
                           ("record", 1, "compute")]
    times = C.COMM_STATS.seconds_by_kind()
    assert times["total"]["all_reduce"] == pytest.approx(2e-3) == times["exposed"]["all_reduce"]


def test_resolve_false_keeps_a_snapshot_that_later_ops_do_not_change(gpu):
    with C._timed("all_reduce", EP, 16, device=CUDA):
        gpu.collective(2.0).wait()
    snapshot = C.COMM_STATS.seconds_by_kind(resolve=False)
    with C._timed("all_reduce", EP, 16, device=CUDA):
        gpu.collective(5.0).wait()
    assert gpu.reads() == []
    assert C.resolved(snapshot)["total"]["all_reduce"] == pytest.approx(2e-3)
    assert C.COMM_STATS.seconds_by_kind()["total"]["all_reduce"] == pytest.approx(7e-3)


def test_many_spans_fold_without_waiting_once_the_gpu_has_run_them(gpu, monkeypatch):
    """A counter that is never read does not grow without bound: past FOLD_AT spans, those whose
    events have fired (a `query`, no wait) are summed into a number."""
    monkeypatch.setattr(Duration, "FOLD_AT", 3)
    total = Duration()
    for _ in range(3):
        with timing.span(CUDA) as span:
            gpu.kernel(1.0)
        total = total + span.duration
    gpu.catch_up()
    with timing.span(CUDA) as span:
        gpu.kernel(1.0)
    total = total + span.duration
    assert not any(entry[0] in ("synchronize", "synchronize_device") for entry in gpu.reads())
    assert len(total._spans) == 1 and total._known == pytest.approx(3e-3)
    assert float(total) == pytest.approx(4e-3)


def test_phase_timer_and_stopwatch(gpu):
    timer = PhaseTimer(CUDA)
    with timer("forward"):
        gpu.kernel(2.0)
    with timer("forward"):
        gpu.kernel(1.0)
    assert gpu.reads() == []
    assert timer.ms() == pytest.approx({"forward": 3.0})
    gpu.log.clear()
    watch = timing.Stopwatch(CUDA)  # measurement mode: waits for the device when it starts and when read
    gpu.kernel(1.0)
    assert watch.seconds() >= 0 and gpu.reads() == [("synchronize_device",), ("synchronize_device",)]


def test_lancet_learns_dw_times_from_events_without_waiting_in_backward(gpu):
    """WGradScheduler times each dW with events; a time enters the seconds-per-FLOP average once
    the GPU has run it (a later dW finds it fired), never by waiting."""
    scheduler = WGradScheduler(AlphaBeta(alpha=0.0, beta=0.0), seconds_per_flop=1.0)
    scheduler._run(1e3, lambda: gpu.kernel(2.0))
    assert scheduler.seconds_per_flop == 1.0 and gpu.reads() == [("query", 1)]  # not run yet: unchanged
    gpu.catch_up()
    scheduler._run(1e3, lambda: gpu.kernel(4.0))
    learned = 1.0 + 0.3 * (2e-3 / 1e3 - 1.0)  # the first dW's 2 ms, smoothing 0.3
    assert scheduler.seconds_per_flop == pytest.approx(learned)
    assert not any(entry[0] in ("synchronize", "synchronize_device") for entry in gpu.reads())


def test_cpu_work_uses_the_host_clock():
    import time

    assert timing.clock(torch.device("cpu")) is timing.HOST and timing.clock(None) is timing.HOST
    with timing.span("cpu") as span:
        time.sleep(0.02)
    assert span.duration.ready() and 0.02 <= float(span.duration) < 1.0
    with timing.wall() as took:
        time.sleep(0.02)
    assert 0.02 <= took.seconds < 1.0
