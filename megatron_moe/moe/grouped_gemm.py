"""Grouped matrix multiply: rows of several experts, each through its own weight, in one call.

    y = grouped_mm(x, w, counts)     x [m, k] (group g's rows contiguous, groups in order)
                                     w [G, k, n], counts[g] rows of group g (sum = m) -> y [m, n]

Two entry points:

* `grouped_mm`: autograd through `w`, whatever `w` is (the replica weights *Trans* moved in are
  not leaves: their gradient must flow back to *Agg*).
* `grouped_mm_into_grad`: `w` is a leaf stack (an expert parameter, one row per group) and its
  gradient is scaled by `scale`. With a Lancet `WGradScheduler`
  (`techniques/lancet/lancet.py`), where torch's kernel is not native (`native_kernel`), and on
  the CPU wherever our dW kernels beat the native backward (`Groups.own_wgrad_pays`), backward
  computes dX and adds dW_g = scale x_g^T dy_g straight into the leaf's `.grad`: no `[G, k, n]`
  gradient is allocated per micro-batch and then added, one read-modify-write of the stack
  instead. Otherwise it is plain autograd through the native kernel. Under `torch.no_grad`
  (generation, evaluation) it is the kernel alone (`_mm`), no autograd Function per call.

Kernels (`native_kernel`, a function of device type, capability, dtype and shape alone):
`torch._grouped_mm`'s own kernel only where it is one kernel with no host sync, else one matmul
per group (`_loop_mm`), split by the counts the caller holds on the host already (the layer's one
counted read, perf/host_sync.py). In torch 2.13 (aten/src/ATen/native/cuda/GroupedBlas.cpp) the
CUDA kernel (CUTLASS, `bf16bf16_grouped_mm`) runs for bf16 operands and output on compute
capability 9.x or 10.x only, with under 1024 groups (GroupMM.cu) and 16-byte strides
(GroupedMMUtils.h); everything else goes to `_grouped_mm_fallback`, which copies the offsets to the
host (`offs.cpu()`, a sync per call) and loops: fp32, fp16, an A100 (8.0), 8.9, 12.x, ROCm.

    device  capability  dtype             groups, k, n                  path
    cpu     -           fp32, bf16, fp16  k, n times itemsize % 16 == 0  native (torch's C++ loop, host offsets)
    cuda    9.x, 10.x   bf16              < 1024; k, n % 8 == 0          native (one CUTLASS kernel)
    any other case (fp64; CUDA fp32 / fp16, 8.x, 12.x, ROCm; mps ...)    loop (no offs.cpu())

On the CPU torch's kernel beats our loop (docs/performance.md: 0.87 against 1.2 ms at 8 groups);
a one-time probe (`_probe`, read through `to_host`) checks it runs where the table says native.

dW (`wgrad_kernel`, `add_wgrad_`) goes into the buffer it is added to; no temporary holds more
than `_WGRAD_TEMP_MAX_ELEMENTS` elements or one group's [k, n], never the whole stack (`_chunks`).
CPU: when the groups are small, one batched `baddbmm_` over the groups padded to the largest count
(`Groups.padding_pays`); else `torch._grouped_mm` into a temporary then added, while the stack is
small; else one `addmm_` per non-empty group, in place. CUDA: the native kernel, a chunk of groups
at a time, where it runs and the buffer has the operands' dtype; otherwise one GEMM per group
(`accumulate_wgrad_`): bf16 operands into the fp32 main gradient are multiplied with fp32 output
(`torch.mm(..., out_dtype=fp32)`), never rounded to bf16 (the native kernel has bf16 output only;
its one call over 32 experts, h 4096, 2f 28672 built a 7.5 GB bf16 stack per micro-batch).
There is no per-expert indexing of a stack in autograd (indexing `w[g]` costs a zero-filled `[G, k, n]`
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

import itertools
import math
from typing import Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch

from megatron_moe.model.precision import accumulate_wgrad_, grad_buffer, has_main_grad
from megatron_moe.perf.host_sync import to_device, to_host

_SUPPORTED: Dict[Tuple[str, torch.dtype], bool] = {}  # did the one-time probe run the kernel?
_REFUSED: Set[Tuple[str, torch.dtype, int, int]] = set()  # shapes the kernel rejected all the same
_CAPABILITY: Dict[torch.device, Tuple[int, int]] = {}
# torch 2.13's native kernels (module docstring): the CPU's dtypes; CUDA's fast path, bf16 on
# these major capabilities (`_scaled_mm_allowed_device(sm90_only, sm100_only)`), under this many
# groups (GroupMM.cu); both want every row of an operand to start on a 16-byte boundary
_CPU_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CUDA_NATIVE_MAJORS = (9, 10)
_CUDA_NATIVE_MAX_GROUPS = 1023
_STRIDE_BYTES = 16
# a dW temporary holds at most this many elements, or one group's [k, n] (module docstring)
_WGRAD_TEMP_MAX_ELEMENTS = 1 << 24
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


def native_kernel(device_type: str, capability: Optional[Tuple[int, int]], dtype: torch.dtype, groups: int,
                  k: int, n: int, rocm: bool = False) -> bool:
    """Is `torch._grouped_mm` of [m, k] rows through G = `groups` [k, n] weights (or dW [G, k, n])
    one native kernel, with no host sync (the table in the module docstring)? `capability`: the
    CUDA device's (major, minor); `rocm`: a ROCm build (its fast path needs CK on gfx942 / 950)."""
    aligned = k * dtype.itemsize % _STRIDE_BYTES == 0 and n * dtype.itemsize % _STRIDE_BYTES == 0
    if device_type == "cpu":
        return dtype in _CPU_NATIVE_DTYPES and aligned
    return (device_type == "cuda" and not rocm and capability is not None and capability[0] in _CUDA_NATIVE_MAJORS
            and dtype == torch.bfloat16 and groups <= _CUDA_NATIVE_MAX_GROUPS and aligned)


def _capability(device: torch.device) -> Optional[Tuple[int, int]]:
    if device.type != "cuda":
        return None
    if device not in _CAPABILITY:
        _CAPABILITY[device] = torch.cuda.get_device_capability(device)
    return _CAPABILITY[device]


def _native(device: torch.device, dtype: torch.dtype, groups: int, k: int, n: int) -> bool:
    """`native_kernel` for this device, the kernel's probe, and no earlier refusal of the shape."""
    return (native_kernel(device.type, _capability(device), dtype, groups, k, n, torch.version.hip is not None)
            and _native_supported(device, dtype) and (device.type, dtype, k, n) not in _REFUSED)


def _native_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Does `torch._grouped_mm` run forward and backward on this device type and dtype (probed
    once, where `native_kernel` says it is native: a build may lack the CUDA kernels)?"""
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
    return bool(to_host(torch.stack([torch.all(y == 8), torch.all(w.grad[1] == 3)]), "grouped_mm probe").all())


class Groups:
    """Row counts of the groups of one grouped product (python ints), with what every kernel of
    its forward and backward needs, computed once: the native kernel's end offsets, the padded
    batch's length."""

    def __init__(self, counts: List[int], device_counts: Optional[torch.Tensor] = None):
        self.counts = counts
        self._offsets: Dict[torch.device, torch.Tensor] = {}
        if device_counts is not None:  # the counts on their device already: the offsets without a copy
            self._offsets[device_counts.device] = device_counts.cumsum(0).to(torch.int32)
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
            self._offsets[device] = to_device([ends], device, "offsets")[0]  # pinned, non-blocking
        return self._offsets[device]

    def part(self, start: int, stop: int) -> "Groups":
        """Groups [start, stop) alone (their offsets from this one's, on the device: no copy)."""
        if (start, stop) == (0, len(self.counts)):
            return self
        part = Groups(self.counts[start:stop])
        for device, ends in self._offsets.items():
            part._offsets[device] = ends[start:stop] - ends[start - 1] if start else ends[:stop]
        return part


def _native_mm(x: torch.Tensor, w: torch.Tensor, groups: Groups) -> Optional[torch.Tensor]:
    """`torch._grouped_mm` (x [m, k] with w [G, k, n], or x [k, m] with w [m, n] -> [G, k, n]),
    or None where it is not one native kernel for this device, dtype and shape (`native_kernel`)."""
    k = x.shape[0] if w.dim() == 2 else x.shape[1]
    key = (x.device.type, x.dtype, k, w.shape[-1])
    if not _native(x.device, x.dtype, len(groups.counts), k, w.shape[-1]):
        return None
    if not (x.is_contiguous() or x.t().is_contiguous()):  # the kernel takes row- or column-major x
        x = x.contiguous()  # (dW's x^T stays a view: transposing a copy cost 3x the product on the CPU)
    try:
        if torch.is_autocast_enabled(x.device.type):
            with torch.autocast(x.device.type, enabled=False):
                return torch._grouped_mm(x, w, offs=groups.offsets(x.device))
        return torch._grouped_mm(x, w, offs=groups.offsets(x.device))
    except RuntimeError:  # not foreseen by `native_kernel` (e.g. a misaligned view): the loop from now on
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


def wgrad_kernel(device_type: str, native: bool, same_dtype: bool, padding_pays: bool, stack_elements: int) -> str:
    """How `add_wgrad_` computes dW into a [G, k, n] buffer (module docstring): "padded", "native"
    (the kernel into temporaries of `_chunks`, then added) or "per_group". `native`: the kernel is
    native here (`native_kernel`); `same_dtype`: the buffer has the operands' dtype (not bf16 into
    an fp32 main gradient)."""
    if device_type == "cpu":  # measured: benchmarks/grouped_gemm.py
        if padding_pays:
            return "padded"
        return "native" if native and stack_elements <= _NATIVE_TEMP_MAX_ELEMENTS else "per_group"
    return "native" if native and same_dtype else "per_group"  # per group: fp32 products (accumulate_wgrad_)


def _chunks(counts: List[int], group_elements: int) -> Iterator[Tuple[int, int, int, int]]:
    """(first group, end group, first row, end row) of runs of groups whose dW [G', k, n] holds at
    most `_WGRAD_TEMP_MAX_ELEMENTS` elements (at least one group each); runs without rows skipped."""
    step = max(1, _WGRAD_TEMP_MAX_ELEMENTS // max(1, group_elements))
    ends = list(itertools.accumulate(counts, initial=0))
    for start in range(0, len(counts), step):
        stop = min(start + step, len(counts))
        if ends[stop] > ends[start]:
            yield start, stop, ends[start], ends[stop]


def _per_group(out: torch.Tensor, x: torch.Tensor, dy: torch.Tensor, counts: List[int], alpha: float) -> None:
    for g, (rows, grads) in enumerate(zip(x.split(counts), dy.split(counts))):
        if rows.shape[0]:
            accumulate_wgrad_(out[g], rows.t(), grads, alpha)


def add_wgrad_(out: torch.Tensor, x: torch.Tensor, dy: torch.Tensor, groups: Groups, alpha: float = 1.0) -> None:
    """out [G, k, n] += alpha x_g^T dy_g for every group g (x [m, k], dy [m, n], rows grouped by
    `groups`) by `wgrad_kernel`'s choice; on row buckets where `_bucketed` (zero rows add nothing).
    No temporary holds more than one chunk (`_chunks`)."""
    if _bucketed(x):
        x, _, _ = _to_buckets(x, groups)
        dy, groups, _ = _to_buckets(dy, groups)
    counts = groups.counts
    kernel = wgrad_kernel(out.device.type, _native(x.device, x.dtype, len(counts), x.shape[1], dy.shape[1]),
                          out.dtype == x.dtype, groups.padding_pays, out.numel())
    if kernel == "per_group":
        _per_group(out, x, dy, counts, alpha)
    elif kernel == "padded" and out.dtype == x.dtype:  # in place: no temporary
        length = max(counts)
        out.baddbmm_(_padded(x, counts, length).transpose(1, 2), _padded(dy, counts, length), alpha=alpha)
    else:  # into a temporary per chunk of groups, then added
        for start, stop, first, end in _chunks(counts, math.prod(out.shape[1:])):
            part, rows, grads = groups.part(start, stop), x[first:end], dy[first:end]
            if kernel == "padded":  # bf16 operands, fp32 main gradient: the CPU has no fp32-output bf16 kernel
                length = max(part.counts)
                product = torch.bmm(_padded(rows, part.counts, length).transpose(1, 2),
                                    _padded(grads, part.counts, length))
            else:
                product = _native_mm(rows.t(), grads, part)  # CUDA: from the caching allocator
            if product is None:  # refused after all (`_native_mm`)
                _per_group(out[start:stop], rows, grads, part.counts, alpha)
            else:
                out[start:stop].add_(product, alpha=alpha)


def _autocast_pair(x: torch.Tensor, w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, w = x.to(dtype), w.to(dtype)
    if x.dtype != w.dtype:
        raise ValueError(f"grouped_mm: rows are {x.dtype}, weights {w.dtype}")
    return x, w


def _groups(x: torch.Tensor, weights: int, counts: Sequence[int], device_counts: Optional[torch.Tensor]) -> Groups:
    counts = [int(c) for c in counts]
    if len(counts) != weights or sum(counts) != x.shape[0]:
        raise ValueError(f"grouped_mm: {len(counts)} groups of {sum(counts)} rows for {weights} weights "
                         f"and {x.shape[0]} rows")
    return Groups(counts, device_counts if device_counts is not None and device_counts.device == x.device else None)


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


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: Sequence[int],
               device_counts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [m, k], w [G, k, n], counts [G] (python ints; `device_counts`: the same on x's device, if
    the caller has them there) -> [m, n], differentiable in x and w."""
    return _grouped_mm_autograd(x, w, _groups(x, w.shape[0], counts, device_counts))


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
                         scheduler=None, device_counts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`grouped_mm(x, leaf viewed [G, k, n], counts)`, differentiable in x only: the weight
    gradient, times `scale`, goes straight into `leaf.grad`, in backward or, with a Lancet
    `WGradScheduler`, when that runs its deferred work."""
    groups = _groups(x, leaf.shape[0], counts, device_counts)
    if not torch.is_grad_enabled():  # inference: the same product, no autograd Function or dW plan per call
        return _mm(*_autocast_pair(x, _held(leaf.detach())), groups)
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    if (scheduler is None and not has_main_grad(leaf) and not _bucketed(x)
            and _native(x.device, dtype, len(groups.counts), leaf.shape[1], math.prod(leaf.shape[2:]))
            and not groups.own_wgrad_pays(x.device, leaf[0].numel() * len(groups.counts))):
        # autograd: the native backward's dW (through the scale) into `.grad`
        return _grouped_mm_autograd(x, scale_grad(_held(leaf), scale), groups)
    return _GroupedMMIntoGrad.apply(x, leaf, float(scale), groups, scheduler)
