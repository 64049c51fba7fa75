"""Every host read of device data in the per-layer hot path, counted (issue #44 item 3).

On a GPU, reading device data on the host blocks the host until the GPU has run everything queued
before the read: the host stops issuing kernels and collectives, and the GPU idles once it has
run what was queued. Megatron-Core's MoE layer needs one such read per forward: the token counts
that size the all-to-all (its splits are host integers). So does ours (`docs/running.md`, "Host
syncs"): every read goes through `to_host`, and `HOST_SYNCS` counts them.

* `to_host(t)` / `to_host_all(tensors)`: one copy down (CUDA: into pinned memory, non-blocking,
  then a wait on an event recorded after it; the wait is the sync) -> host tensors. Several
  tensors of one dtype travel in one copy. Under `torch.cuda.set_sync_debug_mode("error")` the
  helper sets the mode to "default" around its own copy, so a test can assert that nothing else
  syncs.
* `to_device(tensors, device)`: host integer tensors (permutations, counts, offsets) -> the device
  in one pinned buffer and one non-blocking copy (a pageable or blocking host-to-device copy
  waits for the stream too). On the CPU the tensors are returned as they are (views).
* `HOST_SYNCS`: reads (`reads`, by label `by_label`) and uploads since `reset()`.

`OBSERVERS` and `busy()` let a test tell the helper's work from other code's
(`tests/host_reads.py`).
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Callable, List, Sequence

import torch

OBSERVERS: List[Callable[[str, object], None]] = []  # called (kind, outputs) after each helper call
_BUSY = [0]


def busy() -> bool:
    """Is the helper copying (its own reads are not another caller's)?"""
    return _BUSY[0] > 0


class HostSyncs:
    """Helper calls since `reset()`: `reads` (device-to-host, each a sync on a GPU), `by_label`
    (reads per caller's label), `uploads` (host-to-device buffers, asynchronous)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.reads, self.uploads, self.by_label = 0, 0, Counter()

    @contextmanager
    def counting(self):
        """with HOST_SYNCS.counting() as window: work(); window.reads: what `work` read (also after)."""
        window = _Window(self)
        try:
            yield window
        finally:
            window.end = (self.reads, self.uploads, Counter(self.by_label))


class _Window:
    def __init__(self, syncs: HostSyncs):
        self.syncs, self.end = syncs, None
        self.start = (syncs.reads, syncs.uploads, Counter(syncs.by_label))

    def _now(self):
        s = self.syncs
        return self.end or (s.reads, s.uploads, s.by_label)

    @property
    def reads(self) -> int:
        return self._now()[0] - self.start[0]

    @property
    def uploads(self) -> int:
        return self._now()[1] - self.start[1]

    @property
    def by_label(self) -> Counter:
        return self._now()[2] - self.start[2]


HOST_SYNCS = HostSyncs()


@contextmanager
def _helper():
    _BUSY[0] += 1
    previous = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)  # the one allowed sync
    try:
        yield
    finally:
        if previous is not None:
            torch.cuda.set_sync_debug_mode(previous)
        _BUSY[0] -= 1


def to_host_all(tensors: Sequence[torch.Tensor], label: str = "") -> List[torch.Tensor]:
    """Device tensors of one dtype -> host copies (same shapes), read in one copy: one sync."""
    tensors = [t.detach() for t in tensors]
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise ValueError(f"to_host_all: one dtype per read, got {sorted(map(str, dtypes))}")
    with _helper():
        flat = torch.cat([t.reshape(-1) for t in tensors]) if len(tensors) > 1 else tensors[0].reshape(-1)
        if flat.device.type == "cuda":
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(flat.device))
            done.synchronize()
        else:
            host = flat.to("cpu", copy=True)
        out = [piece.view(t.shape) for piece, t in zip(host.split([t.numel() for t in tensors]), tensors)]
    HOST_SYNCS.reads += 1
    HOST_SYNCS.by_label[label] += 1
    for observe in OBSERVERS:
        observe("to_host", out)
    return out


def to_host(t: torch.Tensor, label: str = "") -> torch.Tensor:
    """A device tensor -> its host copy (one sync)."""
    return to_host_all([t], label)[0]


def to_device(tensors: Sequence[torch.Tensor], device: torch.device, label: str = "") -> List[torch.Tensor]:
    """Host integer tensors -> the same on `device` (dtypes and shapes kept) in one pinned buffer
    and one non-blocking copy; on the CPU, views of the tensors themselves."""
    device = torch.device(device)
    with _helper():
        if device.type != "cuda":
            out = [t.view_as(t) for t in tensors]
        else:
            if any(t.is_floating_point() for t in tensors):
                raise ValueError("to_device sends integer tensors (permutations, counts, offsets)")
            buffer = torch.empty(sum(t.numel() for t in tensors), dtype=torch.int64, pin_memory=True)
            torch.cat([t.reshape(-1).to(torch.int64) for t in tensors], out=buffer)
            flat = buffer.to(device, non_blocking=True)
            out = [piece.view(t.shape).to(t.dtype)
                   for piece, t in zip(flat.split([t.numel() for t in tensors]), tensors)]
    HOST_SYNCS.uploads += 1
    for observe in OBSERVERS:
        observe("to_device", out)
    return out
