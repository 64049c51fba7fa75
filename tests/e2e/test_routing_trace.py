"""Routing traces, load metrics and pictures of a real run (issue 5, items 4-5).

A 2-rank run (expert parallel 2, data parallel 2, capacity 1.0 so that tokens drop) records a
trace; an independent single-process replay of the same training (router outputs captured by
forward hooks, micro-batch j belonging to data-parallel source j % 2) must give exactly the same
[source, expert] counts and drops. The run's metrics must agree with the trace, TensorBoard must
hold the heatmap and the per-layer scalars, and the plot tool must write the PNGs.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_moe.config import load_config
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.moe.router import Router
from megatron_moe.moe.routing_trace import load_routing_trace
from megatron_moe.training.trainer import Trainer

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "gpt_moe_tiny.yaml")
ITERS, DP, EXPERTS = 3, 2, 8
OVERRIDES = [f"training.train_iters={ITERS}", "training.log_interval=1", "training.eval_interval=0",
             "model.seq_length=32", "training.micro_batch_size=1", "training.global_batch_size=4",
             "moe.capacity_factor=1.0", "logging.routing_trace=true", "logging.image_interval=2"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("trace_run")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={DP}",
           "pretrain_gpt_moe.py", "--config", CONFIG, "parallel.expert=2", f"training.run_dir={run_dir}"] + OVERRIDES
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir


def replay_counts(tmp_path):
    """Single-process replay: ([iters, layers, DP, E] counts, [iters, layers, DP] drops) from hooks."""
    cfg = load_config(CONFIG, OVERRIDES + ["logging.routing_trace=false", f"training.run_dir={tmp_path}"])
    trainer = Trainer(cfg, ParallelState.single_process())
    routers = [m for m in trainer.model.modules() if isinstance(m, Router)]
    calls = []  # per forward of each router, in order: (layer, expert_ids [n, k], kept [n, k])
    for layer, router in enumerate(routers):
        router.register_forward_hook(lambda mod, inp, out, layer=layer: calls.append((layer, out.expert_ids, out.kept)))
    counts = np.zeros((ITERS, len(routers), DP, EXPERTS), dtype=np.int64)
    dropped = np.zeros((ITERS, len(routers), DP), dtype=np.int64)
    for i in range(ITERS):
        calls.clear()
        trainer.train_step(i + 1)
        assert len(calls) == len(routers) * trainer.num_micro_batches
        for index, (layer, expert_ids, kept) in enumerate(calls):
            source = (index // len(routers)) % DP  # micro-batch j runs on data-parallel rank j % DP
            counts[i, layer, source] += np.bincount(expert_ids.flatten().numpy(), minlength=EXPERTS)
            dropped[i, layer, source] += int((~kept).sum())
    return counts, dropped




def test_trace_replays_to_the_same_counts(run, tmp_path, one_thread):
    trace = load_routing_trace(str(run / "routing"))
    assert trace.iterations.tolist() == [1, 2, 3]
    assert trace.counts.shape == (ITERS, 2, DP, EXPERTS)
    assert trace.header["num_sources"] == DP and trace.header["moe_layer_indices"] == [0, 1]
    tokens = trace.header["tokens_per_iteration"]
    assert tokens == 4 * 32 and (trace.counts.sum(axis=(2, 3)) == tokens * trace.header["top_k"]).all()
    counts, dropped = replay_counts(tmp_path)
    np.testing.assert_array_equal(trace.counts, counts)
    np.testing.assert_array_equal(trace.dropped, dropped)
    assert trace.dropped.sum() > 0  # capacity 1.0 did drop, so drops are checked too


def test_metrics_and_tensorboard_agree_with_trace(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trace = load_routing_trace(str(run / "routing"))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    load = trace.expert_load()  # [I, L, E]
    for r, layer_load, drops in zip(records, load, trace.dropped.sum(axis=2)):
        np.testing.assert_allclose(r["balance_degree"], layer_load.std(axis=1))
        np.testing.assert_allclose(r["dropped_fraction"], drops / layer_load.sum(axis=1))
        assert set(r["time_ms"]) == {"forward", "backward", "optimizer", "comm_wait"}
        assert all(v > 0 for v in r["time_ms"].values())
        assert r["comm_bytes"]["all_to_all"] > 0
        # every op kind with bytes has times; synchronous ops: exposed == total
        assert set(r["comm_exposed_ms"]) == set(r["comm_total_ms"]) == set(r["comm_bytes"])
        assert r["comm_exposed_ms"]["all_to_all"] == pytest.approx(r["comm_total_ms"]["all_to_all"])
        assert sum(r["comm_exposed_ms"].values()) == pytest.approx(r["time_ms"]["comm_wait"])
        world = len(r["max_rss_mb"])  # peak memory of every rank: a process with torch loaded > 100 MB
        assert world > 1 and set(r["max_rss_mb"]) == {f"rank{i}" for i in range(world)}
        assert all(100 < v < 24 * 1024 for v in r["max_rss_mb"].values())
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0}).Reload()
    assert [e.step for e in events.Images("expert_load/heatmap")] == [2]  # image_interval=2
    tags = events.Tags()["scalars"]
    for tag in ("balance_degree/layer1", "dropped_fraction/layer0", "expert_load_imbalance/layer0",
                "time_ms/forward", "time_ms/backward", "time_ms/optimizer", "time_ms/comm_wait", "max_rss_mb/rank1"):
        assert tag in tags, tag


def test_plot_tool_writes_pngs(run, tmp_path):
    proc = subprocess.run([sys.executable, "tools/plot_expert_load.py", str(run / "routing"), "--output",
                           str(tmp_path), "--iteration", "2"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in ("heatmap_iter2.png", "expert_share.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
    bad = subprocess.run([sys.executable, "tools/plot_expert_load.py", str(run / "routing"), "--output",
                          str(tmp_path), "--iteration", "9"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "iteration 9 is not in the trace (1..3)" in bad.stderr
