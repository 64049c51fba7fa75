"""An independent count of host reads of device data (issue #44 item 3), for CPU tests.

On a GPU, reading device data on the host (`.item()`, `.tolist()`, `.cpu()`, `int()` / `bool()` /
`float()` of a tensor, `nonzero`, `bincount`, `unique`, boolean-mask indexing, `torch.equal`, a
tensor-valued `repeat_interleave` without `output_size`, `np.asarray(t)`, a tensor in an f-string, ...) blocks the host until the GPU has
caught up. On the CPU all tensors live in one place, so `HostReads` tells device data apart by
where it came from: a tensor is device data when it is computed (by any torch function, in place
or not) from device data, and the sources of device data are the tensors passed to `HostReads`
(a layer's parameters and input), host data sent down (`torch.tensor(data, device=...)`,
`t.to(device)`) and what `host_sync.to_device` returns. What `host_sync.to_host` (or `.cpu()`)
returns is host data: the helper's own reads are counted apart (`helper`), everything else that
reads device data on the host is counted in `reads` (with where it happened, `sites`). A tensor
made from nothing (`torch.arange(n, device=d)`) becomes device data once it meets device data.

A host tensor sent down without the helper (`torch.tensor(..., device=...)`, `host.to(device)`)
is a blocking host-to-device copy on a GPU: counted in `uploads`.
"""
from __future__ import annotations

import traceback
from collections import Counter
from typing import Iterable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from megatron_moe.perf import host_sync

_T = torch.Tensor
# `__array__`: numpy of a tensor (np.asarray(t)); `__format__`: a tensor in an f-string
READS = {_T.item, _T.tolist, _T.numpy, _T.cpu, _T.__array__, _T.__format__, _T.__bool__, _T.__int__, _T.__float__,
         _T.__index__}
IMPLICIT = {torch.nonzero, _T.nonzero, torch.argwhere, _T.argwhere, torch.bincount, _T.bincount, torch.unique,
            _T.unique, torch.unique_consecutive, _T.unique_consecutive, torch.masked_select, _T.masked_select,
            torch.equal, _T.equal}
INDEXING = {_T.__getitem__, _T.__setitem__, _T.index_put_, _T.index_put, torch.index_put}
FACTORIES_FROM_DATA = {torch.tensor, torch.as_tensor}
_MARK = "_host_reads_device"


def _tensors(*trees) -> list:
    leaves, _ = tree_flatten(list(trees))
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def on_device(t: torch.Tensor) -> bool:
    return getattr(t, _MARK, False)


def _mark(outputs) -> None:
    for t in _tensors(outputs):
        try:
            setattr(t, _MARK, True)
        except (AttributeError, RuntimeError):
            pass


def _device_given(args, kwargs) -> bool:
    return kwargs.get("device") is not None or any(isinstance(a, (torch.device, str)) for a in args[1:])


class HostReads(TorchFunctionMode):
    """with HostReads(sources) as reads: forward(); then reads.reads, reads.helper, reads.uploads."""

    def __init__(self, sources: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.reads, self.uploads, self.helper = 0, 0, 0
        self.sites: Counter = Counter()
        self.sources = list(sources)

    def __enter__(self):
        _mark(self.sources)
        host_sync.OBSERVERS.append(self._helper_call)
        return super().__enter__()

    def __exit__(self, *exc):
        host_sync.OBSERVERS.remove(self._helper_call)
        return super().__exit__(*exc)

    def _helper_call(self, kind: str, outputs) -> None:
        """host_sync's own calls: a read (to_host: host data out) or an upload (to_device: device data out)."""
        if kind == "to_host":
            self.helper += 1
        else:
            _mark(outputs)

    def _site(self, name: str) -> None:
        frames = [f for f in traceback.extract_stack()[:-2] if "megatron_moe" in f.filename]
        where = f"{frames[-1].filename.split('megatron_moe/')[-1]}:{frames[-1].lineno}" if frames else "?"
        self.sites[f"{name} @ {where}"] += 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if host_sync.busy():  # inside the helper: its own copy, counted by `_helper_call`
            return func(*args, **kwargs)
        inputs = _tensors(args, kwargs)
        device_in = any(on_device(t) for t in inputs)
        name = getattr(func, "__name__", str(func))
        if device_in and self._reads(func, args, kwargs, inputs):
            self.reads += 1
            self._site(name)
        out = func(*args, **kwargs)
        moved = func in (_T.to, _T.cuda) and _device_given(args, kwargs)
        uploaded = func in FACTORIES_FROM_DATA and kwargs.get("device") is not None  # torch.tensor(data, device=)
        if (moved or uploaded) and not device_in:  # host data sent down
            self.uploads += 1
            self._site(f"upload {name}")
            if any(out is t for t in inputs):  # `.to` returned its input: keep the host tensor host data
                out = out.view_as(out)  # (this mode is off inside its own __torch_function__)
        if func in (_T.cpu, _T.numpy):  # what .cpu() returns is host data (on the CPU: the same tensor)
            return out.view_as(out) if any(out is t for t in inputs) else out
        if device_in or moved or uploaded:
            _mark(out)
        return out

    @staticmethod
    def _reads(func, args, kwargs, inputs) -> bool:
        if func in READS or func in IMPLICIT:
            return True
        if func in FACTORIES_FROM_DATA:  # python lists of device scalars are read one by one
            return bool(args) and isinstance(args[0], (list, tuple))
        if func in (_T.to, _T.cuda):
            return _device_given(args, kwargs)
        if func in (torch.repeat_interleave, _T.repeat_interleave):
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if len(args) == 1 else None)
            return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None and len(args) < 4
        if func in INDEXING:  # a boolean mask among the indices (not the value written)
            return any(t.dtype in (torch.bool, torch.uint8) for t in _tensors(args[1] if len(args) > 1 else ()))
        if func is torch.where:
            return len(args) + len(kwargs) == 1
        return False
