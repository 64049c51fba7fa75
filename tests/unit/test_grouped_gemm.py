"""grouped_mm and grouped_mm_into_grad == per-group matmuls, forward and backward, on each of their paths
(moe/grouped_gemm.py)."""
import pytest
import torch

from megatron_moe.moe import grouped_gemm
from megatron_moe.moe.grouped_gemm import _GroupedMM, grouped_mm, grouped_mm_into_grad

COUNTS = [3, 0, 5, 1, 0, 7]  # empty groups in the middle and at the end


def _reference(x, w, counts):
    return torch.cat([rows @ w[g] for g, rows in enumerate(x.split(counts))])


@pytest.mark.parametrize("path", ["native", "loop"])
def test_grouped_mm_matches_per_group_matmuls(path, monkeypatch):
    if path == "loop":
        monkeypatch.setattr(grouped_gemm, "_native_supported", lambda device, dtype: False)
    elif not grouped_gemm._native_supported(torch.device("cpu"), torch.float32):
        pytest.skip("torch._grouped_mm does not run here")
    gen = torch.Generator().manual_seed(0)
    counts = COUNTS + [0]
    x = torch.randn(sum(counts), 8, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(len(counts), 8, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(sum(counts), 12, generator=gen, dtype=torch.float64)
    y = grouped_mm(x, w, counts)
    (y * dy).sum().backward()
    dx, dw = x.grad, w.grad
    x.grad = w.grad = None
    ref = _reference(x, w, counts)
    (ref * dy).sum().backward()
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, x.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dw, w.grad, rtol=1e-12, atol=1e-12)
    assert torch.equal(dw[1], torch.zeros(8, 12, dtype=torch.float64))  # empty group: zero gradient


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
