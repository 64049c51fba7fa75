"""Routing-trace format (megatron_moe/moe/routing_trace.py) and the per-layer load metrics."""
import json

import numpy as np
import pytest
import torch

from megatron_moe.moe.load_plots import shares
from megatron_moe.moe.routing_trace import RoutingTraceWriter, load_routing_trace
from megatron_moe.training.metrics import layer_load_metrics

HEADER = {"num_moe_layers": 2, "moe_layer_indices": [1, 3], "num_sources": 3, "num_experts": 4, "top_k": 2,
          "tokens_per_iteration": 64}


def _matrix(iteration, salt=0):
    """(counts [L, S, E], dropped [L, S], micro_counts [L, S, M, E]) of one iteration, M = 2."""
    rng = np.random.default_rng(iteration * 10 + salt)
    micro = rng.integers(0, 50, size=(2, 3, 2, 4))
    return micro.sum(2), rng.integers(0, 5, size=(2, 3)), micro


def test_chunks_resume_and_window(tmp_path):
    writer = RoutingTraceWriter(str(tmp_path), HEADER, chunk_iters=2)
    for i in range(1, 6):  # chunks 1-2, 3-4, and 5 on close
        writer.append(i, *_matrix(i))
    writer.close()
    assert sorted(p.name for p in tmp_path.glob("counts_*.npz")) == [
        "counts_00000001.npz", "counts_00000003.npz", "counts_00000005.npz"]
    resumed = RoutingTraceWriter(str(tmp_path), HEADER, chunk_iters=2)  # a run resumed at iteration 4
    for i in range(4, 7):
        resumed.append(i, *_matrix(i, salt=1))
    resumed.close()

    # chunk 3-4 is cut to 3, chunk 5 (stale) is gone
    assert sorted(p.name for p in tmp_path.glob("counts_*.npz")) == [
        "counts_00000001.npz", "counts_00000003.npz", "counts_00000004.npz", "counts_00000006.npz"]
    trace = load_routing_trace(str(tmp_path))
    assert trace.iterations.tolist() == [1, 2, 3, 4, 5, 6]
    assert trace.counts.dtype == np.int32 and trace.counts.shape == (6, 2, 3, 4)
    for row, i in enumerate(trace.iterations):
        counts, dropped, micro = _matrix(i, salt=int(i >= 4))  # the resumed run wins where both wrote
        np.testing.assert_array_equal(trace.counts[row], counts)
        np.testing.assert_array_equal(trace.dropped[row], dropped)
        np.testing.assert_array_equal(trace.micro_counts[row], micro)
    np.testing.assert_array_equal(trace.expert_load()[0], _matrix(1)[0].sum(axis=1))
    assert trace.header["moe_layer_indices"] == [1, 3] and trace.header["chunk_iters"] == 2
    window = load_routing_trace(str(tmp_path), first=2, last=4)
    assert window.iterations.tolist() == [2, 3, 4]
    np.testing.assert_array_equal(window.counts[2], _matrix(4, salt=1)[0])


def test_version_1_traces_load_without_micro_batches(tmp_path):
    (tmp_path / "header.json").write_text(json.dumps({**HEADER, "format": "megatron_moe.routing_trace", "version": 1}))
    counts, dropped, _ = _matrix(1)
    np.savez_compressed(tmp_path / "counts_00000001.npz", iterations=np.array([1]), counts=counts[None].astype(np.int32),
                        dropped=dropped[None].astype(np.int32))
    trace = load_routing_trace(str(tmp_path))
    assert trace.micro_counts is None
    np.testing.assert_array_equal(trace.counts[0], counts)


def test_not_a_trace(tmp_path):
    with pytest.raises(ValueError, match="no header.json"):
        load_routing_trace(str(tmp_path))
    (tmp_path / "header.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not a megatron_moe.routing_trace"):
        load_routing_trace(str(tmp_path))


def test_layer_load_metrics_and_shares():
    counts = torch.tensor([[4, 4, 4, 4], [10, 0, 6, 0]])
    m = layer_load_metrics(counts, torch.tensor([0, 4]))
    assert m["balance_degree"] == pytest.approx([0.0, np.std([10, 0, 6, 0])])  # population std (Pro-Prophet)
    assert m["dropped_fraction"] == pytest.approx([0.0, 0.25])
    np.testing.assert_allclose(shares(np.array([[1, 3], [0, 0]])), [[25.0, 75.0], [0.0, 0.0]])
