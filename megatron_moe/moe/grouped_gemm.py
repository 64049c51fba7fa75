"""Grouped matrix multiply: rows of several experts, each through its own weight, in one call.

    y = grouped_mm(x, w, counts)     x [m, k] (group g's rows contiguous, groups in order)
                                     w [G, k, n], counts[g] rows of group g (sum = m) -> y [m, n]

`torch._grouped_mm` (one kernel over all groups; CPU and CUDA) is used where it runs for the
device and dtype, probed once per (device type, dtype); otherwise `_LoopGroupedMM`, one matmul
per group inside a single autograd node: its backward writes each group's weight gradient into
one `[G, k, n]` buffer. Either way there is no per-expert indexing of the stacked weight in
autograd (indexing `w[g]` costs a zero-filled `[G, k, n]` gradient per group, O(G^2) memory
traffic: issue #16). Under autocast both operands are cast to the autocast dtype first, as
`torch.matmul` would be. Both paths give the plain per-group matmuls' result (tests/unit/test_grouped_gemm.py).
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Set, Tuple

import torch

_SUPPORTED: Dict[Tuple[str, torch.dtype], bool] = {}
_REFUSED: Set[Tuple[str, torch.dtype, int, int]] = set()  # shapes the native kernel rejected (alignment)


def _native_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Does `torch._grouped_mm` run forward and backward on this device type and dtype?"""
    key = (device.type, dtype)
    if key not in _SUPPORTED:
        ok = hasattr(torch, "_grouped_mm")
        if ok:
            try:  # saved normally: a probe inside a recomputed region must not count as its activations
                with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), torch.enable_grad():
                    ok = _probe(device, dtype)
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        _SUPPORTED[key] = ok
    return _SUPPORTED[key]


def _probe(device: torch.device, dtype: torch.dtype) -> bool:
    """One tiny `torch._grouped_mm`, forward and backward, checked against the known result."""
    x = torch.ones(4, 8, device=device, dtype=dtype, requires_grad=True)
    w = torch.ones(2, 8, 16, device=device, dtype=dtype, requires_grad=True)
    offs = torch.tensor([1, 4], device=device, dtype=torch.int32)
    with torch.autocast(device.type, enabled=False):
        y = torch._grouped_mm(x, w, offs=offs)
        y.backward(torch.ones_like(y))
    return bool(torch.all(y == 8)) and bool(torch.all(w.grad[1] == 3))


class _LoopGroupedMM(torch.autograd.Function):
    """One matmul per group; one gradient buffer for the whole weight stack."""

    @staticmethod
    def forward(ctx, x, w, counts: List[int]):
        ctx.save_for_backward(x, w)
        ctx.counts = counts
        y = x.new_empty((x.shape[0], w.shape[2]))
        for g, (rows, out) in enumerate(zip(x.split(counts), y.split(counts))):
            if rows.shape[0]:
                torch.mm(rows, w[g], out=out)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad = grad.contiguous()
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        dw = torch.zeros_like(w) if ctx.needs_input_grad[1] else None
        for g, (rows, dy) in enumerate(zip(x.split(ctx.counts), grad.split(ctx.counts))):
            if not rows.shape[0]:
                continue
            if dx is not None:
                torch.mm(dy, w[g].t(), out=dx.narrow(0, sum(ctx.counts[:g]), rows.shape[0]))
            if dw is not None:
                torch.mm(rows.t(), dy, out=dw[g])
        return dx, dw, None


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """x [m, k], w [G, k, n], counts [G] (python ints) -> [m, n]; see the module docstring."""
    counts = [int(c) for c in counts]
    if len(counts) != w.shape[0] or sum(counts) != x.shape[0]:
        raise ValueError(f"grouped_mm: {len(counts)} groups of {sum(counts)} rows for {w.shape[0]} weights "
                         f"and {x.shape[0]} rows")
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, w = x.to(dtype), w.to(dtype)
    if x.dtype != w.dtype:
        raise ValueError(f"grouped_mm: rows are {x.dtype}, weights {w.dtype}")
    shape_key = (x.device.type, x.dtype, w.shape[1], w.shape[2])
    if _native_supported(x.device, x.dtype) and shape_key not in _REFUSED:
        offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(x.device)
        try:
            with torch.autocast(x.device.type, enabled=False):
                return torch._grouped_mm(x.contiguous(), w, offs=offs)
        except RuntimeError:  # e.g. CUDA kernels want 16-byte aligned k and n
            _REFUSED.add(shape_key)
    return _LoopGroupedMM.apply(x, w, counts)
