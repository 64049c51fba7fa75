"""Pipeline programs (training/pipeline_schedules.py), the layer split (model/pipeline_stages.py) and
the distributed optimizer's pieces, without process groups."""
import dataclasses
import itertools

import pytest
import torch

from megatron_moe.config import load_config
from megatron_moe.distributed.parallel_state import ParallelState, RankLayout
from megatron_moe.model.gpt import GPTMoEModel
from megatron_moe.model.pipeline_stages import StageChunks, model_chunk_layers
from megatron_moe.training.distributed_optimizer import flat_range_boxes
from megatron_moe.training.pipeline_schedules import (Compute, Exchange, expected_bubble, forward_only, programs,
                                                      simulate)


@pytest.mark.parametrize("times", [(1.0, 2.0), (1.0, 1.0), (3.0, 5.0)])
def test_simulated_bubble_is_the_papers(times):
    """Unit compute times, messages free: 1F1B idles (p-1)/(m+p-1) of the time on every stage,
    interleaved 1F1B (p-1)/(v m+p-1) (Narayanan et al. SC'21 §2.2)."""
    for p, m in itertools.product((1, 2, 3, 4), (1, 2, 3, 4, 8)):
        sim = simulate(programs("1f1b", p, m, 1), 1, *times)
        assert sim.bubble == pytest.approx([expected_bubble(p, m)] * p), (p, m)
    for p, v, k in itertools.product((2, 4), (2, 3), (1, 2, 3)):
        m = k * p
        sim = simulate(programs("interleaved", p, m, v), v, *times)
        assert sim.bubble == pytest.approx([expected_bubble(p, m, v)] * p), (p, v, m)
        assert sim.mean_bubble < simulate(programs("1f1b", p, m, 1), 1, *times).mean_bubble


def test_programs_run_each_chunk_and_micro_batch_once():
    for name, p, m, v in [("1f1b", 4, 6, 1), ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 3)]:
        for stage, prog in enumerate(programs(name, p, m, v)):
            computes = [s for s in prog if isinstance(s, Compute)]
            for backward in (False, True):
                done = sorted((s.chunk, s.micro_batch) for s in computes if s.backward == backward)
                assert done == sorted(itertools.product(range(v), range(m))), (name, stage, backward)
            # each chunk runs its micro-batches in order, forward and backward
            for chunk, backward in itertools.product(range(v), (False, True)):
                order = [s.micro_batch for s in computes if s.chunk == chunk and s.backward == backward]
                assert order == sorted(order)
    for stage, prog in enumerate([forward_only(3, s, 4, 2) for s in range(3)]):
        assert not any(isinstance(s, Compute) and s.backward for s in prog)
    simulate([forward_only(3, s, 4, 2) for s in range(3)], 2)


def test_one_f_one_b_shape():
    """One stage: forward j, backward j (the plain gradient-accumulation loop). Stage s of p keeps
    at most p - s micro-batches in flight (1F1B's activation memory bound)."""
    assert programs("1f1b", 1, 3, 1)[0] == [Compute(b, 0, j) for j in range(3) for b in (False, True)]
    p, m = 4, 8
    for s, prog in enumerate(programs("1f1b", p, m, 1)):
        in_flight, most = 0, 0
        for step in prog:
            if isinstance(step, Compute):
                in_flight += -1 if step.backward else 1
                most = max(most, in_flight)
        assert most == p - s


@pytest.mark.parametrize("p, v, m", [(2, 2, 2), (2, 2, 4), (2, 3, 6), (4, 2, 4), (4, 2, 8), (4, 3, 12), (3, 2, 9)])
def test_interleaved_warmup_bounds_micro_batches_in_flight(p, v, m):
    """Interleaved 1F1B's activation memory: stage s runs Megatron's warm-up of exactly
    w = min((p - s - 1) * 2 + (v - 1) * p, v m) forwards (all v m when m == p), then one forward + one
    backward per steady step, then the remaining backwards; so it keeps at most min(w + 1, v m)
    (chunk, micro-batch) activations in flight. A longer warm-up leaves gradients and the bubble
    unchanged: only this bound catches it."""
    total = v * m
    for s, prog in enumerate(programs("interleaved", p, m, v)):
        warmup = total if m == p else min((p - s - 1) * 2 + (v - 1) * p, total)
        steady = total - warmup
        kinds = ["B" if step.backward else "F" for step in prog if isinstance(step, Compute)]
        assert kinds == ["F"] * warmup + ["F", "B"] * steady + ["B"] * warmup, (p, v, m, s)
        in_flight, most = 0, 0
        for kind in kinds:
            in_flight += 1 if kind == "F" else -1
            most = max(most, in_flight)
        assert most == min(warmup + 1, total), (p, v, m, s)


def test_simulation_rejects_mismatched_messages_and_deadlocks():
    progs = programs("1f1b", 2, 2, 1)
    # stage 1 expects micro-batch 1's activations before micro-batch 0's: the messages do not match
    swapped = [list(progs[0]), [Exchange(recv_forward=(0, 1)) if s == Exchange(recv_forward=(0, 0)) else s
                                for s in progs[1]]]
    with pytest.raises(AssertionError, match="expects"):
        simulate(swapped, 1)
    # stage 0 never sends micro-batch 1: stage 1 waits forever
    dropped = [[dataclasses.replace(s, send_forward=None) if isinstance(s, Exchange) and s.send_forward == (0, 1)
                else s for s in progs[0]], progs[1]]
    with pytest.raises(AssertionError, match="deadlock|never matched"):
        simulate(dropped, 1)


def test_layer_split():
    cfg = load_config(None, ["model.num_layers=8", "parallel.pipeline=2", "parallel.virtual_stages=2",
                             "parallel.pipeline_schedule=interleaved"])
    assert model_chunk_layers(cfg) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    stage1 = StageChunks.of(cfg, 1)
    assert stage1.layers == (range(2, 4), range(6, 8))
    assert not stage1.is_first(0) and stage1.is_last(1) and stage1.has_head and not stage1.has_embedding
    cfg = load_config(None, ["model.num_layers=5", "parallel.pipeline=2", "parallel.pipeline_layers=[1,4]"])
    assert model_chunk_layers(cfg) == [range(0, 1), range(1, 5)]
    assert StageChunks.of(cfg, 0).layers == (range(0, 1),)


def test_stage_models_keep_global_names_and_seed_values():
    """A pipeline stage's parameters are the same-named tensors of the single-process model;
    the last stage holds the tied word table under the first stage's name, marked for the sums."""
    overrides = ["model.num_layers=4", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.vocab_size=50",
                 "model.seq_length=8", "moe.num_experts=2", "moe.expert_ffn_hidden_size=32"]
    full = dict(GPTMoEModel(load_config(None, overrides), ParallelState.single_process()).named_parameters())
    cfg = load_config(None, overrides + ["parallel.pipeline=2"])
    layout = RankLayout(world_size=2, pipeline=2)
    stages = [dict(GPTMoEModel(cfg, ParallelState.build(layout, r)).named_parameters()) for r in range(2)]
    assert {n.split(".")[1] for n in stages[0] if n.startswith("layers.")} == {"0", "1"}
    assert {n.split(".")[1] for n in stages[1] if n.startswith("layers.")} == {"2", "3"}
    assert "embedding.position" in stages[0] and "embedding.position" not in stages[1]
    assert "final_norm.weight" in stages[1] and "final_norm.weight" not in stages[0]
    assert set(stages[0]) | set(stages[1]) == set(full)
    for stage in stages:
        for name, p in stage.items():
            assert torch.equal(p, full[name]), name
    word0, word1 = stages[0]["embedding.word.weight"], stages[1]["embedding.word.weight"]
    assert word0.tied_across_stages and word1.tied_across_stages
    assert not word0.pipeline_duplicate and word1.pipeline_duplicate


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 4), (2, 1, 3, 2)])
def test_flat_range_boxes_cover_exactly_the_range(shape):
    index = torch.arange(torch.Size(shape).numel()).view(shape)
    n = index.numel()
    for start in range(n):
        for stop in range(start + 1, n + 1):
            boxes = flat_range_boxes(shape, start, stop)
            pieces = [index[tuple(slice(o, o + s) for o, s in zip(off, size))].reshape(-1) for off, size in boxes]
            assert torch.equal(torch.cat(pieces), torch.arange(start, stop)), (shape, start, stop, boxes)
            assert len(boxes) <= 2 * len(shape) - 1
