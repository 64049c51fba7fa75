"""grouped_mm == per-group matmuls, forward and backward, on both of its paths (moe/grouped_gemm.py)."""
import pytest
import torch

from megatron_moe.moe import grouped_gemm
from megatron_moe.moe.grouped_gemm import _LoopGroupedMM, grouped_mm

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
    _LoopGroupedMM.apply(x, w, COUNTS).sum().backward()
    assert w.grad is not None and x.grad is None
