"""grouped_mm and grouped_mm_into_grad == per-group matmuls, forward and backward, on each of their paths
(moe/grouped_gemm.py); the path choice's table (issue #44 item 5): torch's kernel only where it is native
(no host sync), dW temporaries bounded by a chunk of groups, never the whole stack."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_moe.moe import grouped_gemm
from megatron_moe.moe.grouped_gemm import _GroupedMM, grouped_mm, grouped_mm_into_grad, native_kernel, wgrad_kernel
from megatron_moe.perf.host_sync import HOST_SYNCS
from tests.host_reads import HostReads

COUNTS = [3, 0, 5, 1, 0, 7]  # empty groups in the middle and at the end


def _reference(x, w, counts):
    return torch.cat([rows @ w[g] for g, rows in enumerate(x.split(counts))])


@pytest.mark.parametrize("path", ["native", "loop"])
def test_grouped_mm_matches_per_group_matmuls(path, monkeypatch):
    """fp32 (k, n rows of 16 bytes: torch's CPU kernel is native) and fp64 (the loop)."""
    dtype, tol = (torch.float32, 1e-5) if path == "native" else (torch.float64, 1e-12)
    calls = []
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, _f=torch._grouped_mm, **k: calls.append(1) or _f(*a, **k))
    gen = torch.Generator().manual_seed(0)
    counts = COUNTS + [0]
    x = torch.randn(sum(counts), 8, generator=gen, dtype=dtype, requires_grad=True)
    w = torch.randn(len(counts), 8, 12, generator=gen, dtype=dtype, requires_grad=True)
    dy = torch.randn(sum(counts), 12, generator=gen, dtype=dtype)
    y = grouped_mm(x, w, counts)
    (y * dy).sum().backward()
    assert bool(calls) == (path == "native")
    dx, dw = x.grad, w.grad
    x.grad = w.grad = None
    ref = _reference(x, w, counts)
    (ref * dy).sum().backward()
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(dx, x.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(dw, w.grad, rtol=tol, atol=tol)
    assert torch.equal(dw[1], torch.zeros(8, 12, dtype=dtype))  # empty group: zero gradient


def test_grouped_mm_under_autocast_and_errors():
    x, w = torch.randn(16, 8), torch.randn(6, 8, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = grouped_mm(x, w, COUNTS)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), _reference(x, w, COUNTS), rtol=2e-2, atol=5e-2)
    with pytest.raises(ValueError, match="groups"):
        grouped_mm(x, w, [1, 2])
    with pytest.raises(ValueError, match="rows"):
        grouped_mm(x[:10], w, COUNTS)


def test_loop_backward_skips_unneeded_gradients():
    x, w = torch.randn(16, 8), torch.randn(6, 8, 4, requires_grad=True)
    _GroupedMM.apply(x, w, grouped_gemm.Groups(COUNTS)).sum().backward()
    assert w.grad is not None and x.grad is None


@pytest.mark.parametrize("path", ["padded", "native", "per-group"])
def test_grouped_mm_into_grad_accumulates_scaled_weight_gradients(path, monkeypatch):
    """dW goes into the leaf's `.grad`, times the scale, and adds up over calls as autograd's
    accumulation would; dX is autograd's. Each CPU dW kernel is forced in turn."""
    monkeypatch.setattr(grouped_gemm, "_PAD_MAX_ROWS_PER_GROUP", 100 if path == "padded" else 0)
    monkeypatch.setattr(grouped_gemm, "_PAD_MAX_BLOWUP", 100)
    monkeypatch.setattr(grouped_gemm, "_NATIVE_TEMP_MAX_ELEMENTS", 1 << 30 if path == "native" else 0)
    gen = torch.Generator().manual_seed(2)
    leaf = torch.nn.Parameter(torch.randn(4, 8, 2, 3, generator=gen, dtype=torch.float64))  # [stack, k, (2,) n]
    counts = [3, 0, 5, 1]
    want_grad = torch.zeros_like(leaf)
    for step in range(2):  # the second call accumulates onto the first's gradient
        x = torch.randn(sum(counts), 8, generator=gen, dtype=torch.float64, requires_grad=True)
        dy = torch.randn(sum(counts), 6, generator=gen, dtype=torch.float64)
        y = grouped_mm_into_grad(x, leaf, 0.5, counts)
        (y * dy).sum().backward()
        x_ref, w_ref = x.detach().clone().requires_grad_(True), leaf.detach().clone().requires_grad_(True)
        ref = _reference(x_ref, w_ref.reshape(len(counts), 8, 6), counts)
        (ref * dy).sum().backward()
        torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
        want_grad += 0.5 * w_ref.grad
        torch.testing.assert_close(leaf.grad, want_grad, rtol=1e-12, atol=1e-12)
    assert float(leaf.grad[1].abs().sum()) == 0.0  # a stack row that computed nothing


def test_grouped_mm_into_grad_under_autocast_keeps_an_fp32_gradient():
    gen = torch.Generator().manual_seed(3)
    leaf = torch.nn.Parameter(torch.randn(6, 8, 4, generator=gen))
    x = torch.randn(16, 8, generator=gen, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = grouped_mm_into_grad(x, leaf, 1.0, COUNTS)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    w_ref = leaf.detach().clone().requires_grad_(True)
    _reference(x.detach(), w_ref, COUNTS).sum().backward()
    assert leaf.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    torch.testing.assert_close(leaf.grad, w_ref.grad, rtol=2e-2, atol=5e-2)


def test_padding_pays_only_for_many_small_groups():
    pays = lambda counts: grouped_gemm.Groups(counts).padding_pays  # noqa: E731
    assert pays([2] * 100 + [6] + [0] * 27)  # 128 experts, 256 rows: calls dominate
    assert not pays([32] * 8)  # 8 experts of 32 rows: few calls to save
    assert not pays([200, 1, 1, 1])  # padding 3 x 199 rows
    assert not pays([5])  # one group: nothing to batch


def test_cpu_bf16_row_buckets_repeat_shapes_and_change_no_number(monkeypatch):
    """CPU bf16 (oneDNN compiles a kernel per new shape): every kernel call sees group row counts
    that are multiples of `_ROW_BUCKET`, and the results equal the unbucketed per-group products
    (forward, dX, dW into the fp32 main gradient); fp32 is not bucketed."""
    bucket = grouped_gemm._ROW_BUCKET
    counts = [3, 0, 37, bucket, 1, 70]
    groups = grouped_gemm.Groups(counts)
    padded, positions = groups.bucketed()
    assert padded.counts == [bucket, 0, 2 * bucket, bucket, bucket, 3 * bucket]
    starts = [0, bucket, bucket, 3 * bucket, 4 * bucket, 5 * bucket]
    assert positions.tolist() == [s + i for s, c in zip(starts, counts) for i in range(c)]
    assert grouped_gemm.Groups([bucket, 0, 2 * bucket]).bucketed()[1] is None  # aligned already: no copy
    assert not grouped_gemm._bucketed(torch.zeros(1, 1)) and grouped_gemm._bucketed(torch.zeros(1, 1, dtype=torch.bfloat16))

    seen = []
    native = grouped_gemm._native_mm

    def spy(x, w, g):
        seen.append(list(g.counts))
        return native(x, w, g)

    monkeypatch.setattr(grouped_gemm, "_native_mm", spy)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), 16, generator=gen).bfloat16().requires_grad_()
    leaf = torch.nn.Parameter(torch.randn(len(counts), 16, 24, generator=gen).bfloat16())
    leaf.main_grad = torch.zeros(leaf.shape)  # bf16 runs: dW goes into the fp32 main gradient
    dy = torch.randn(sum(counts), 24, generator=gen).bfloat16()
    y = grouped_mm_into_grad(x, leaf, 0.5, counts)
    (y.float() * dy.float()).sum().backward()
    ref_x = x.detach().clone().requires_grad_()
    ref = _reference(ref_x, leaf.detach(), counts)
    (ref.float() * dy.float()).sum().backward()
    ref_dw = torch.stack([(rows.t().float() @ grads.float()) for rows, grads in zip(x.detach().split(counts), dy.split(counts))])
    if seen:  # the native kernel ran (elsewhere the loop did, on the same bucketed counts)
        assert all(c % bucket == 0 for call in seen for c in call), seen
    torch.testing.assert_close(y.float(), ref.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(x.grad.float(), ref_x.grad.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(leaf.main_grad, 0.5 * ref_dw, rtol=1e-2, atol=5e-2)
    assert leaf.grad is None


# -- the path choice (issue #44 item 5) ---------------------------------------------------------------
BF16, FP32, FP16 = torch.bfloat16, torch.float32, torch.float16


@pytest.mark.parametrize("device, capability, dtype, groups, k, n, rocm, native", [
    ("cpu", None, FP32, 32, 64, 128, False, True),  # torch's C++ loop over host offsets: faster than ours
    ("cpu", None, BF16, 32, 64, 128, False, True),
    ("cpu", None, FP16, 32, 64, 128, False, True),
    ("cpu", None, torch.float64, 32, 64, 128, False, False),  # the kernel takes fp32 / bf16 / fp16 only
    ("cpu", None, FP32, 32, 6, 128, False, False),  # rows of 24 bytes: the kernel wants 16-byte strides
    ("cuda", (9, 0), BF16, 32, 4096, 28672, False, True),  # H100 / H200: CUTLASS, no sync
    ("cuda", (10, 0), BF16, 1023, 4096, 28672, False, True),  # B200
    ("cuda", (9, 0), BF16, 1024, 4096, 28672, False, False),  # GroupMM.cu: group_count < 1024
    ("cuda", (9, 0), BF16, 32, 4100, 28672, False, False),  # k * 2 bytes not a multiple of 16
    ("cuda", (9, 0), BF16, 32, 4096, 12, False, False),  # nor n
    ("cuda", (9, 0), FP32, 32, 4096, 28672, False, False),  # fp32: the fallback, offs.cpu() per call
    ("cuda", (9, 0), FP16, 32, 4096, 28672, False, False),
    ("cuda", (8, 0), BF16, 32, 4096, 28672, False, False),  # A100: the fallback
    ("cuda", (8, 9), BF16, 32, 4096, 28672, False, False),  # L40
    ("cuda", (12, 0), BF16, 32, 4096, 28672, False, False),  # sm120: not in sm90_only / sm100_only
    ("cuda", (9, 0), BF16, 32, 4096, 28672, True, False),  # ROCm
    ("cuda", None, BF16, 32, 4096, 28672, False, False),
    ("mps", None, BF16, 32, 4096, 28672, False, False),
    ("meta", None, BF16, 32, 4096, 28672, False, False),
])
def test_native_kernel_table(device, capability, dtype, groups, k, n, rocm, native):
    """torch._grouped_mm only where torch 2.13 runs it as one kernel (GroupedBlas.cpp's fast path,
    or the CPU's): everywhere else its fallback copies the offsets to the host, and ours loops."""
    assert native_kernel(device, capability, dtype, groups, k, n, rocm) is native


@pytest.mark.parametrize("device, native, same_dtype, padding_pays, stack, kernel", [
    ("cuda", True, False, False, 32 * 4096 * 28672, "per_group"),  # bf16 into fp32 main_grad: fp32 products
    ("cuda", True, True, False, 32 * 4096 * 28672, "native"),  # in chunks (`_chunks`)
    ("cuda", False, True, False, 64, "per_group"),  # fp32, A100: addmm_ in place
    ("cuda", False, False, True, 64, "per_group"),
    ("cpu", True, False, True, 1 << 30, "padded"),  # measured (benchmarks/grouped_gemm.py): kept
    ("cpu", True, False, False, 1 << 20, "native"),
    ("cpu", True, True, False, (1 << 20) + 1, "per_group"),
    ("cpu", False, True, False, 64, "per_group"),
])
def test_wgrad_kernel_table(device, native, same_dtype, padding_pays, stack, kernel):
    assert wgrad_kernel(device, native, same_dtype, padding_pays, stack) == kernel


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_add_wgrad_of_no_group_is_a_no_op(dtype):
    """A rank that holds no expert (vExpert slots all free): an empty stack, nothing to add."""
    out = torch.zeros(0, 8, 16)
    grouped_gemm.add_wgrad_(out, torch.zeros(0, 8, dtype=dtype), torch.zeros(0, 16, dtype=dtype), grouped_gemm.Groups([]))
    assert out.shape == (0, 8, 16)


class _NewTensors(TorchDispatchMode):
    """Every tensor an op allocates (its own storage, not a view or an in-place result): shape, dtype."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = out if isinstance(out, (tuple, list)) else [out]
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        self.made += [(tuple(t.shape), t.dtype) for t in flat
                      if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs]
        return out


class _RunNow:
    """A Lancet `WGradScheduler` stand-in that runs each dW at once (the own-dW path)."""

    @staticmethod
    def defer(flops, work, params):
        work()


def _wgrad(dtype, limit, monkeypatch):
    """One grouped_mm_into_grad forward and backward over a [6, 64, 64] stack (bf16 with an fp32
    main gradient, or fp32 through Lancet's own-dW path) -> (dW, the tensors backward made)."""
    monkeypatch.setattr(grouped_gemm, "_WGRAD_TEMP_MAX_ELEMENTS", limit, raising=False)
    gen = torch.Generator().manual_seed(5)
    counts, k, n = [3, 0, 17, 32, 1, 20], 64, 64
    leaf = torch.nn.Parameter(torch.randn(len(counts), k, n, generator=gen).to(dtype))
    leaf.main_grad = torch.zeros(leaf.shape) if dtype == BF16 else None
    leaf.grad = None if dtype == BF16 else torch.zeros_like(leaf)  # the buffers dW goes into exist already
    x = torch.randn(sum(counts), k, generator=gen).to(dtype).requires_grad_()
    y = grouped_mm_into_grad(x, leaf, 0.5, counts, None if dtype == BF16 else _RunNow())
    with _NewTensors() as new:
        y.backward(torch.randn(y.shape, generator=gen).to(dtype))
    return (leaf.main_grad if dtype == BF16 else leaf.grad), new.made, leaf


@pytest.mark.parametrize("dtype", [BF16, FP32])
@pytest.mark.parametrize("kernel", ["padded", "native", "cuda"])
def test_wgrad_temporaries_are_bounded_by_a_chunk(kernel, dtype, monkeypatch):
    """No tensor dW's backward makes holds the whole local stack (at 32 experts, h 4096, 2f 28672:
    7.5 GB of bf16 per micro-batch, issue #44 item 5): weight-shaped temporaries hold one chunk
    (here 2 groups) at most, whichever kernel runs (each CPU one forced; "cuda": CUDA's choice,
    one fp32-output product per group for bf16 into fp32). The chunks sum what one temporary
    would have, bit for bit for torch's kernel."""
    monkeypatch.setattr(grouped_gemm, "_PAD_MAX_ROWS_PER_GROUP", 1 << 30 if kernel == "padded" else 0)
    monkeypatch.setattr(grouped_gemm, "_PAD_MAX_BLOWUP", 1 << 30)
    monkeypatch.setattr(grouped_gemm, "_NATIVE_TEMP_MAX_ELEMENTS", 1 << 30 if kernel == "native" else 1 << 20)
    if kernel == "cuda":
        choose = grouped_gemm.wgrad_kernel
        monkeypatch.setattr(grouped_gemm, "wgrad_kernel", lambda device, *rest: choose("cuda", *rest), raising=False)
    limit = 2 * 64 * 64
    dw, made, leaf = _wgrad(dtype, limit, monkeypatch)
    weight_shaped = [shape for shape, _ in made if shape[-2:] == (64, 64)]
    assert max(torch.Size(shape).numel() for shape, _ in made) < leaf.numel(), made
    assert all(torch.Size(shape).numel() <= limit for shape in weight_shaped), weight_shaped
    whole, _, _ = _wgrad(dtype, 1 << 30, monkeypatch)  # one temporary (the padded batch: longer rows)
    if kernel == "padded":
        torch.testing.assert_close(dw, whole, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(dw, whole)


@pytest.mark.parametrize("path", ["native", "loop"])
def test_grouped_products_read_nothing_on_the_host(path):
    """The chosen path, forward and backward (an independent count, tests/host_reads.py): no host
    read of device data, no host data sent down outside the helper; the loop splits by the host
    counts the layer already holds, the kernel takes the device counts' offsets."""
    dtype = FP32 if path == "native" else torch.float64  # CPU: fp32 native, fp64 the loop
    gen = torch.Generator().manual_seed(7)
    counts = [5, 0, 9, 2]
    x = torch.randn(sum(counts), 8, generator=gen, dtype=dtype, requires_grad=True)
    w = torch.randn(len(counts), 8, 16, generator=gen, dtype=dtype, requires_grad=True)
    leaf = torch.nn.Parameter(torch.randn(len(counts), 8, 16, generator=gen, dtype=dtype))
    device_counts = torch.tensor(counts)
    with HostReads([x, w, leaf, device_counts]) as reads, HOST_SYNCS.counting() as helper:
        y = grouped_mm(x, w, counts, device_counts) + grouped_mm_into_grad(x, leaf, 0.5, counts, None, device_counts)
        y.sum().backward()
    assert (reads.reads, reads.uploads, helper.reads) == (0, 0, 0), reads.sites


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_gpu_chosen_path_syncs_only_in_the_helper(dtype):
    """`make test-gpu`: on the present GPU (an A100 or fp32: our loop, not torch's fallback with its
    offs.cpu(); sm90 / sm100 bf16: the kernel) a grouped product's forward and backward, dW into
    the fp32 main gradient, under sync debug mode "error": any sync outside the helper raises."""
    device, counts, k, n = torch.device("cuda"), [24, 0, 40, 8], 64, 128
    native = native_kernel("cuda", torch.cuda.get_device_capability(), dtype, len(counts), k, n,
                           torch.version.hip is not None)
    gen = torch.Generator(device).manual_seed(0)
    leaf = torch.nn.Parameter(torch.randn(len(counts), k, n, generator=gen, device=device).to(dtype))
    if dtype == BF16:
        leaf.main_grad = torch.zeros(leaf.shape, device=device)
    x = torch.randn(sum(counts), k, generator=gen, device=device).to(dtype).requires_grad_()
    dy = torch.randn(sum(counts), n, generator=gen, device=device).to(dtype)
    device_counts = torch.tensor(counts, device=device)
    grouped_mm_into_grad(x, leaf, 1.0, counts, None, device_counts).backward(dy)  # warm-up: one-time probes
    leaf.grad = x.grad = None
    if dtype == BF16:
        leaf.main_grad.zero_()
    calls = []
    original = torch._grouped_mm
    torch._grouped_mm = lambda *a, **kw: calls.append(1) or original(*a, **kw)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with HOST_SYNCS.counting() as helper:
            grouped_mm_into_grad(x, leaf, 1.0, counts, None, device_counts).backward(dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch._grouped_mm = original
    assert helper.reads == 0 and bool(calls) == native
    want = torch.stack([r.t().float() @ g.float() for r, g in zip(x.detach().split(counts), dy.split(counts))])
    got = leaf.main_grad if dtype == BF16 else leaf.grad
    torch.testing.assert_close(got.float(), want, rtol=1e-2 if dtype == BF16 else 1e-4, atol=1e-2)
