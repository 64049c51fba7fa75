"""Every time measurement of the project, right on the CPU and on CUDA (issue #27).

On the CPU, host code and gloo's collectives have ended when the call returns: `perf_counter()`
around them is their time. On CUDA, a kernel launch, an NCCL collective and `work.wait()` return
before the work ends, so a host clock around them reads launch overhead. The helpers here take
the device the work runs on and do the right thing on each:

* `span(device)` (hot path): `with span(x.device) as s: work()` then `s.duration`, a `Duration`.
  CPU: the host clock. CUDA: two events recorded on the current stream (the one that runs the
  work), before and after it, read lazily: nothing waits for the GPU until a value is read
  (`float(duration)`), which the trainer does after its step's own synchronize.
* `AsyncTiming` (an asynchronous collective, `distributed/collectives.py`): *exposed* = the issue
  call plus the time the caller was blocked in `wait()`, *total* = issue to completion. CUDA:
  events on the compute stream before and after the issue and around `work.wait()` (how long the
  compute stream stood still), and the completion as an event on a separate completion stream
  made to wait for the work (it fires when the collective ends, not when the compute stream gets
  there). CPU (gloo): the host clock, completion = when `wait()` returns (an upper bound).
* `Stopwatch(device)` / `wall(device)` (measurement mode): synchronize the device, then read the
  host clock; every read synchronizes again. Step times, benchmarks, start-up calibration,
  Lancet's op profile: places that want the wall time of finished work and may wait for it.
* `Stopwatch()` / `wall()` without a device: host-only work (planners, the simulator, tools).

The CUDA calls go through a small device API object (`CudaEvents`); tests substitute a stub that
records the calls in the order a GPU would see them (`override`, tests/unit/test_timing.py).
torch is imported where CUDA is used, so host-only tools (data preprocessing) stay torch-free.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Optional, Sequence, Tuple



class Duration:
    """Seconds that may not be known yet: a known part plus device spans (clock, start, end) that
    are read on first use (`seconds()`, `float()`). Values never change once made: `+` returns a
    new one, so a reference kept as a snapshot stays valid. Pickling and `copy` resolve it."""

    __slots__ = ("_known", "_spans")
    FOLD_AT = 512  # spans kept before the finished ones are read (no wait); 4x that: read them all

    def __init__(self, seconds: float = 0.0, spans: Tuple = ()):
        self._known, self._spans = float(seconds), tuple(spans)

    def __add__(self, other):
        if isinstance(other, (int, float)):
            return Duration(self._known + other, self._spans)
        if not isinstance(other, Duration):
            return NotImplemented
        joined = Duration(self._known + other._known, self._spans + other._spans)
        if len(joined._spans) > self.FOLD_AT:
            joined._fold(wait=len(joined._spans) > 4 * self.FOLD_AT)
        return joined

    __radd__ = __add__

    def _fold(self, wait: bool) -> None:
        """Move finished spans (all of them if `wait`) into the known part. The value is unchanged."""
        kept = []
        for clock, start, end in self._spans:
            if wait:
                self._known += clock.elapsed(start, end)
            elif clock.ready(end):  # `end` has fired, so has `start` (it comes before it)
                self._known += clock.elapsed(start, end, wait=False)
            else:
                kept.append((clock, start, end))
        self._spans = tuple(kept)

    def ready(self) -> bool:
        """Can it be read without waiting for the device?"""
        return all(clock.ready(end) for clock, _, end in self._spans)

    def seconds(self) -> float:
        """The value; waits for the device only for spans that have not ended yet."""
        if self._spans:
            self._fold(wait=False)
        if self._spans:
            self._fold(wait=True)
        return self._known

    __float__ = seconds

    def __reduce__(self):
        return Duration, (self.seconds(),)

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __repr__(self) -> str:
        return f"Duration({self._known!r}{f', +{len(self._spans)} spans' if self._spans else ''})"


class HostClock:
    """Work that has ended when the call returns: host code, gloo's CPU collectives."""

    def mark(self, stream: Any = None) -> float:
        return time.perf_counter()

    def span(self, start: float, end: float) -> Duration:
        return Duration(end - start)

    def completed(self, works: Sequence, now: float) -> float:
        """When the waited `works` ended: the host has just returned from waiting for them."""
        return now

    def ready(self, mark) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CudaEvents:
    """The CUDA calls `DeviceClock` makes (a stub with the same methods stands in for it in tests)."""

    def __init__(self):
        import torch

        self._completion = {}  # device index -> the stream that observes collectives' completion
        self.cuda = torch.cuda

    def current_stream(self):
        return self.cuda.current_stream()

    def completion_stream(self):
        index = self.cuda.current_device()
        if index not in self._completion:
            self._completion[index] = self.cuda.Stream(index)
        return self._completion[index]

    def on(self, stream):
        return self.cuda.stream(stream)

    def record(self, stream):
        event = self.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def query(self, event) -> bool:
        return event.query()

    def synchronize(self, event) -> None:
        event.synchronize()

    def elapsed_ms(self, start, end) -> float:
        return start.elapsed_time(end)

    def synchronize_device(self) -> None:
        self.cuda.synchronize()


class DeviceClock:
    """Events on the stream that runs the work; read lazily (`Duration`)."""

    def __init__(self, api):
        self.api = api

    def mark(self, stream: Any = None):
        return self.api.record(self.api.current_stream() if stream is None else stream)

    def span(self, start, end) -> Duration:
        return Duration(0.0, ((self, start, end),))

    def completed(self, works: Sequence, now):
        """An event that fires when `works` end: recorded on the completion stream after making it
        wait for them (`work.wait()` blocks the current stream, not the host)."""
        stream = self.api.completion_stream()
        with self.api.on(stream):
            for work in works:
                work.wait()
            return self.api.record(stream)

    def ready(self, mark) -> bool:
        return self.api.query(mark)

    def elapsed(self, start, end, wait: bool = True) -> float:
        """Seconds from `start` to `end` (waits for both to fire unless they have)."""
        if wait:
            self.api.synchronize(start)
            self.api.synchronize(end)
        return self.api.elapsed_ms(start, end) / 1e3

    def synchronize(self) -> None:
        self.api.synchronize_device()


HOST = HostClock()
_cuda_clock: Optional[DeviceClock] = None
_override: Optional[Any] = None


def clock(device=None):
    """The clock of work on `device` (a torch.device, a string, or None: host work)."""
    if _override is not None:
        return _override
    kind = getattr(device, "type", None) or str(device).split(":")[0]  # torch.device or "cuda:0"
    if device is None or kind != "cuda":
        return HOST
    global _cuda_clock
    if _cuda_clock is None:
        _cuda_clock = DeviceClock(CudaEvents())
    return _cuda_clock


@contextmanager
def override(replacement):
    """Every `clock(...)` inside returns `replacement` (tests: a `DeviceClock` over a stub API)."""
    global _override
    previous, _override = _override, replacement
    try:
        yield replacement
    finally:
        _override = previous


class span:
    """`with span(device) as s: work()` -> `s.duration`: the work's time on `device` (lazy on CUDA)."""

    def __init__(self, device=None):
        self.clock = clock(device)
        self.duration = Duration()

    def __enter__(self) -> "span":
        self._start = self.clock.mark()
        return self

    def __exit__(self, *exc) -> None:
        self.duration = self.clock.span(self._start, self.clock.mark())


class AsyncTiming:
    """The marks of one asynchronous op: made right before it is issued; `issued()` right after;
    `wait(works)` waits for it and returns (exposed, total) `Duration`s (module docstring)."""

    def __init__(self, device=None):
        self.clock = clock(device)
        self.start = self.clock.mark()
        self.issue_end = self.start

    def issued(self) -> None:
        self.issue_end = self.clock.mark()

    def wait(self, works: Sequence) -> Tuple[Duration, Duration]:
        c = self.clock
        before = c.mark()
        for work in works:
            work.wait()
        after = c.mark()
        done = c.completed(works, after)
        return c.span(self.start, self.issue_end) + c.span(before, after), c.span(self.start, done)


class Stopwatch:
    """Measurement mode: wall seconds of finished work. Synchronizes `device` when it starts and at
    every read (none: host-only work)."""

    def __init__(self, device=None):
        self.clock = clock(device)
        self.clock.synchronize()
        self.start = time.perf_counter()

    def seconds(self) -> float:
        self.clock.synchronize()
        return time.perf_counter() - self.start


@contextmanager
def wall(device=None):
    """`with wall(device) as w: work()` -> `w.seconds`: synchronized wall time (measurement mode)."""
    watch = Stopwatch(device)
    result = _WallResult()
    yield result
    result.seconds = watch.seconds()


class _WallResult:
    seconds: float = 0.0


def measure(fn: Callable[[], object], device=None) -> float:
    """Wall seconds of `fn()` in measurement mode."""
    with wall(device) as w:
        fn()
    return w.seconds
