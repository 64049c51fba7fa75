"""Grouped matrix multiply: rows of several experts, each through its own weight, in one call.

    y = grouped_mm(x, w, counts)     x [m, k] (group g's rows contiguous, groups in order)
                                     w [G, k, n], counts[g] rows of group g (sum = m) -> y [m, n]

Two entry points:

* `grouped_mm`: autograd through `w`, whatever `w` is (the replica weights *Trans* moved in are
  not leaves: their gradient must flow back to *Agg*).
* `grouped_mm_into_grad`: `w` is a leaf stack (an expert parameter, one row per group) and its
  gradient is scaled by `scale`. With a Lancet `WGradScheduler`
  (`techniques/lancet/lancet.py`), and on the CPU wherever our dW kernels beat the native backward
  (`Groups.own_wgrad_pays`), backward computes dX and adds dW_g = scale x_g^T dy_g straight into
  the leaf's `.grad`: no `[G, k, n]` gradient is allocated per micro-batch and then added, one
  read-modify-write of the stack instead. Otherwise it is plain autograd through the native kernel.

Kernels: `torch._grouped_mm` (one kernel over all groups; CPU and CUDA) where it runs forward and
backward for the device and dtype (probed once per (device type, dtype)); otherwise one matmul per
group (`_loop_mm`). dW on the CPU: when the groups are small, one batched `baddbmm_` over the
groups padded to the largest count (`_padding_pays`); else `torch._grouped_mm` into a temporary
then added, while the stack is small; else one `addmm_` per non-empty group, in place. On CUDA:
`torch._grouped_mm`'s single kernel into a temporary, then added. There is no
per-expert indexing of a stack in autograd (indexing `w[g]` costs a zero-filled `[G, k, n]`
gradient per group, O(G^2) memory traffic). bf16 runs (`model/precision.py`): the operands are
bf16, products accumulate in fp32 inside the kernels, and `grouped_mm_into_grad` always adds dW
into the leaf's fp32 `main_grad` (no bf16 [G, k, n] gradient for autograd to hand over and a
hook to fold in). Under autocast both operands are cast to the autocast
dtype first, as `torch.matmul` would be. Every path gives the plain per-group matmuls' result up to
float rounding (tests/unit/test_grouped_gemm.py).

Row buckets (CPU, bf16 / fp16): oneDNN, which runs the CPU's low-precision GEMMs (AMX / AVX512-BF16),
JIT-compiles a kernel for every new shape and caches it by shape. A group's row count changes with
the routing at every step, so an unbucketed bf16 expert GEMM compiles a kernel per group per call:
measured on a Xeon with AMX, `torch._grouped_mm` of 4096 rows over 8 groups, [256, 1024] weights,
took 22-24 ms with fresh counts against 2.7 ms with repeated ones (a single `mm` of 300-800 rows:
1.4 ms against 0.25 ms). There each group's rows are padded with zero rows to a multiple of
`_ROW_BUCKET` (`Groups.bucketed`), so the shapes repeat (4096 rows: 128 sizes per weight shape) and
the waste is under `_ROW_BUCKET` rows per group; zero rows add nothing to dW and their outputs are
dropped. fp32 (MKL, no per-shape compile) and CUDA are left as they are.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch

from megatron_moe.model.precision import accumulate_wgrad_, grad_buffer, has_main_grad

_SUPPORTED: Dict[Tuple[str, torch.dtype], bool] = {}
_REFUSED: Set[Tuple[str, torch.dtype, int, int]] = set()  # shapes the native kernel rejected (alignment)
# CPU dW kernels (measured on the 2-core CPU of docs/performance.md, tests/unit/test_grouped_gemm.py):
# a padded batch when the groups are small (per-call overhead dominates) and padding at most
# multiplies the rows by _PAD_MAX_BLOWUP; else the native kernel into a temporary while that is
# small (a large fresh temporary costs more in page faults than the calls it saves); else per group.
_PAD_MAX_ROWS_PER_GROUP = 8
_PAD_MAX_BLOWUP = 8
_NATIVE_TEMP_MAX_ELEMENTS = 1 << 20
_ROW_BUCKET = 32  # CPU bf16 / fp16: each group's rows padded to a multiple of this (module docstring)
_BUCKETED_DTYPES = (torch.bfloat16, torch.float16)


def _bucketed(x: torch.Tensor) -> bool:
    """Are `x`'s grouped products padded to row buckets (CPU, low precision: module docstring)?"""
    return x.device.type == "cpu" and x.dtype in _BUCKETED_DTYPES


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


class Groups:
    """Row counts of the groups of one grouped product (python ints), with what every kernel of
    its forward and backward needs, computed once: the native kernel's end offsets, the padded
    batch's length."""

    def __init__(self, counts: List[int]):
        self.counts = counts
        self._offsets: Dict[torch.device, torch.Tensor] = {}
        self._bucketed: Optional[Tuple["Groups", torch.Tensor]] = None
        busy, rows = sum(1 for c in counts if c), sum(counts)
        # CPU dW: one `baddbmm_` over every group padded to the largest count, not a call per group?
        self.padding_pays = (busy > 1 and rows <= _PAD_MAX_ROWS_PER_GROUP * busy
                             and len(counts) * max(counts) <= _PAD_MAX_BLOWUP * rows)

    def own_wgrad_pays(self, device: torch.device, stack_elements: int) -> bool:
        """Does dW by `add_wgrad_` beat the native kernel's own backward (in C++, no Python per
        call)? On the CPU when the groups are small enough to pad, or the stack so large that the
        native backward's freshly allocated gradient costs more in page faults than per-group
        calls into an existing one; elsewhere never."""
        return device.type == "cpu" and (self.padding_pays or stack_elements > _NATIVE_TEMP_MAX_ELEMENTS)

    def bucketed(self) -> Tuple["Groups", Optional[torch.Tensor]]:
        """(the groups with each count rounded up to `_ROW_BUCKET`, Long[m] each row's position in
        that padded layout; None where every count is a multiple already: the layout is this one),
        computed once (forward and backward share it)."""
        if self._bucketed is None and all(c % _ROW_BUCKET == 0 for c in self.counts):
            self._bucketed = (self, None)
        if self._bucketed is None:
            padded = [-(-c // _ROW_BUCKET) * _ROW_BUCKET for c in self.counts]
            counts = torch.tensor(self.counts, dtype=torch.long)
            starts = torch.tensor(padded, dtype=torch.long).cumsum(0) - torch.tensor(padded, dtype=torch.long)
            shift = torch.repeat_interleave(starts - (counts.cumsum(0) - counts), counts, output_size=sum(self.counts))
            self._bucketed = (Groups(padded), torch.arange(sum(self.counts)) + shift)
        return self._bucketed

    def offsets(self, device: torch.device) -> torch.Tensor:
        if device not in self._offsets:
            ends = torch.tensor(self.counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            self._offsets[device] = ends.to(device)
        return self._offsets[device]


def _native_mm(x: torch.Tensor, w: torch.Tensor, groups: Groups) -> Optional[torch.Tensor]:
    """`torch._grouped_mm` (x [m, k] with w [G, k, n], or x [k, m] with w [m, n] -> [G, k, n]),
    or None where the kernel does not run for this device, dtype or shape."""
    key = (x.device.type, x.dtype, w.shape[-2], w.shape[-1])
    if not _native_supported(x.device, x.dtype) or key in _REFUSED:
        return None
    if not (x.is_contiguous() or x.t().is_contiguous()):  # the kernel takes row- or column-major x
        x = x.contiguous()  # (dW's x^T stays a view: transposing a copy cost 3x the product on the CPU)
    try:
        if torch.is_autocast_enabled(x.device.type):
            with torch.autocast(x.device.type, enabled=False):
                return torch._grouped_mm(x, w, offs=groups.offsets(x.device))
        return torch._grouped_mm(x, w, offs=groups.offsets(x.device))
    except RuntimeError:  # e.g. CUDA kernels want 16-byte aligned k and n
        _REFUSED.add(key)
        return None


def _loop_mm(x: torch.Tensor, w: torch.Tensor, groups: Groups) -> torch.Tensor:
    """[m, k] x [G, k, n] -> [m, n], one matmul per non-empty group."""
    y = x.new_empty((x.shape[0], w.shape[2]))
    for g, (rows, out) in enumerate(zip(x.split(groups.counts), y.split(groups.counts))):
        if rows.shape[0]:
            torch.mm(rows, w[g], out=out)
    return y


def _to_buckets(rows: torch.Tensor, groups: Groups) -> Tuple[torch.Tensor, Groups, Optional[torch.Tensor]]:
    """rows [m, d] grouped by `groups` -> (the rows in the bucketed layout [m', d], zeros between
    groups; the bucketed groups; Long[m] the rows' positions in it, None: `rows` are laid out so
    already). Differentiable in `rows`."""
    padded, positions = groups.bucketed()
    if positions is None:
        return rows, groups, None
    positions = positions.to(rows.device)
    return rows.new_zeros(sum(padded.counts), rows.shape[1]).index_copy_(0, positions, rows), padded, positions


def to_row_buckets(x: torch.Tensor, counts: Sequence[int]) -> Tuple[torch.Tensor, List[int], Optional[torch.Tensor]]:
    """x [m, d] grouped by `counts` -> (x, counts) in the row-bucketed layout where `_bucketed(x)`
    (module docstring), with Long[m] the rows' positions in it to select the results back
    (`out.index_select(0, positions)`), None where the layout is unchanged. A caller that runs
    several grouped products on the same rows (the experts' FFN) pads once instead of per product."""
    if not _bucketed(x):
        return x, list(counts), None
    x, groups, positions = _to_buckets(x, Groups([int(c) for c in counts]))
    return x, groups.counts, positions


def _mm(x: torch.Tensor, w: torch.Tensor, groups: Groups) -> torch.Tensor:
    """The grouped product (no autograd of its own): the native kernel where it runs, else the
    loop; on row buckets where `_bucketed` (module docstring)."""
    if _bucketed(x):
        x, groups, positions = _to_buckets(x, groups)
        y = _mm_kernel(x, w, groups)
        return y if positions is None else y.index_select(0, positions)
    return _mm_kernel(x, w, groups)


def _mm_kernel(x: torch.Tensor, w: torch.Tensor, groups: Groups) -> torch.Tensor:
    y = _native_mm(x, w, groups)
    return y if y is not None else _loop_mm(x, w, groups)


def _padded(rows: torch.Tensor, counts: List[int], length: int) -> torch.Tensor:
    """[m, d] grouped rows -> [G, length, d], group g's rows first, zeros after."""
    sizes = torch.tensor(counts, dtype=torch.long, device=rows.device)
    group = torch.repeat_interleave(torch.arange(len(counts), device=rows.device), sizes, output_size=rows.shape[0])
    within = torch.arange(rows.shape[0], device=rows.device) - (sizes.cumsum(0) - sizes)[group]
    out = rows.new_zeros(len(counts) * length, rows.shape[1])
    return out.index_copy_(0, group * length + within, rows).view(len(counts), length, rows.shape[1])


def add_wgrad_(out: torch.Tensor, x: torch.Tensor, dy: torch.Tensor, groups: Groups, alpha: float = 1.0) -> None:
    """out [G, k, n] += alpha x_g^T dy_g for every group g (x [m, k], dy [m, n], rows grouped by
    `groups`); on row buckets where `_bucketed` (zero rows add nothing)."""
    if _bucketed(x):
        x, _, _ = _to_buckets(x, groups)
        dy, groups, _ = _to_buckets(dy, groups)
    counts = groups.counts
    if out.device.type == "cpu" and groups.padding_pays:
        length = max(counts)
        a, b = _padded(x, counts, length).transpose(1, 2), _padded(dy, counts, length)
        if a.dtype == out.dtype:
            out.baddbmm_(a, b, alpha=alpha)
        else:  # bf16 operands, fp32 main gradient: the CPU has no fp32-output bf16 kernel (model/precision.py)
            out.add_(torch.bmm(a, b), alpha=alpha)
    elif ((out.device.type != "cpu" or out.numel() <= _NATIVE_TEMP_MAX_ELEMENTS)
          and (native := _native_mm(x.t(), dy, groups)) is not None):
        out.add_(native, alpha=alpha)  # one kernel into a temporary (CUDA: from the caching allocator)
    else:
        for g, (rows, grads) in enumerate(zip(x.split(counts), dy.split(counts))):
            if rows.shape[0]:
                accumulate_wgrad_(out[g], rows.t(), grads, alpha)


def _autocast_pair(x: torch.Tensor, w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, w = x.to(dtype), w.to(dtype)
    if x.dtype != w.dtype:
        raise ValueError(f"grouped_mm: rows are {x.dtype}, weights {w.dtype}")
    return x, w


def _groups(x: torch.Tensor, weights: int, counts: Sequence[int]) -> Groups:
    counts = [int(c) for c in counts]
    if len(counts) != weights or sum(counts) != x.shape[0]:
        raise ValueError(f"grouped_mm: {len(counts)} groups of {sum(counts)} rows for {weights} weights "
                         f"and {x.shape[0]} rows")
    return Groups(counts)


class _GroupedMM(torch.autograd.Function):
    """`grouped_mm`'s autograd where the native kernel's own does not run or does not pay
    (`Groups.own_wgrad_pays`): the product and dX through `_mm`, dW by `add_wgrad_`."""

    @staticmethod
    def forward(ctx, x, w, groups: Groups):
        ctx.save_for_backward(x, w)
        ctx.groups = groups
        return _mm(x, w, groups)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad = grad.contiguous()
        dx = _mm(grad, w.transpose(1, 2), ctx.groups) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            dw = torch.zeros_like(w)
            add_wgrad_(dw, x, grad, ctx.groups)
        return dx, dw, None


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """x [m, k], w [G, k, n], counts [G] (python ints) -> [m, n], differentiable in x and w."""
    return _grouped_mm_autograd(x, w, _groups(x, w.shape[0], counts))


def _grouped_mm_autograd(x: torch.Tensor, w: torch.Tensor, groups: Groups) -> torch.Tensor:
    x, w = _autocast_pair(x, w)
    if not _bucketed(x) and not groups.own_wgrad_pays(x.device, w.numel()):
        y = _native_mm(x, w, groups)  # differentiable: torch._grouped_mm's own backward
        if y is not None:
            return y
    return _GroupedMM.apply(x, w, groups)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Identity forward; multiplies the gradient by `scale` in backward."""
    return x if scale == 1.0 else _ScaleGrad.apply(x, scale)


def _held(stack: torch.Tensor) -> torch.Tensor:
    """A stack [G, k, ...] viewed [G, k, n]."""
    return stack.reshape(stack.shape[0], stack.shape[1], math.prod(stack.shape[2:]))


def add_into_grad_(leaf: torch.Tensor, x: torch.Tensor, dy: torch.Tensor, groups: Groups, scale: float) -> None:
    """leaf's gradient (its fp32 `main_grad` in bf16 runs, else `.grad`, created as autograd would)
    viewed [G, k, n] += scale x_g^T dy_g."""
    add_wgrad_(grad_buffer(leaf).view(len(groups.counts), x.shape[1], dy.shape[1]), x, dy, groups, scale)


class _GroupedMMIntoGrad(torch.autograd.Function):
    """Grouped GEMM through a leaf stack; dW accumulated into the leaf's `.grad`."""

    @staticmethod
    def forward(ctx, x, leaf, scale, groups, scheduler):
        x, w = _autocast_pair(x, _held(leaf.detach()))
        ctx.save_for_backward(x)
        ctx.leaf, ctx.scale, ctx.groups, ctx.scheduler = leaf, scale, groups, scheduler
        return _mm(x, w, groups)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        leaf, scale, groups = ctx.leaf, ctx.scale, ctx.groups
        w = _held(leaf.detach()).to(x.dtype)
        grad = grad.to(x.dtype).contiguous()
        dx = _mm(grad, w.transpose(1, 2), groups) if ctx.needs_input_grad[0] else None

        def dw():
            add_into_grad_(leaf, x, grad, groups, scale)

        if ctx.scheduler is None:
            dw()
        else:  # Lancet: run it while a backward all-to-all is in flight (techniques/lancet/lancet.py)
            ctx.scheduler.defer(2.0 * x.shape[0] * x.shape[1] * w.shape[2], dw, (leaf,))
        return dx, None, None, None, None


def grouped_mm_into_grad(x: torch.Tensor, leaf: torch.nn.Parameter, scale: float, counts: Sequence[int],
                         scheduler=None) -> torch.Tensor:
    """`grouped_mm(x, leaf viewed [G, k, n], counts)`, differentiable in x only: the weight
    gradient, times `scale`, goes straight into `leaf.grad`, in backward or, with a Lancet
    `WGradScheduler`, when that runs its deferred work."""
    groups = _groups(x, leaf.shape[0], counts)
    if (scheduler is None and not has_main_grad(leaf) and not _bucketed(x)
            and not groups.own_wgrad_pays(x.device, leaf[0].numel() * len(groups.counts))):
        # autograd: the native backward's dW (through the scale) into `.grad`
        return _grouped_mm_autograd(x, scale_grad(_held(leaf), scale), groups)
    return _GroupedMMIntoGrad.apply(x, leaf, float(scale), groups, scheduler)
