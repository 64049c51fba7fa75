"""The cluster simulator's bytes (megatron_moe/sim/) equal the collectives' counters of real runs.

Each layout runs one real MoE layer (forward + backward, skewed routing, dropless and capacity)
per schedule and balancer on 2, 4 and 8 gloo processes; each rank reports its byte counters
(`COMM_STATS`, every "<kind>/<group>" key, and the part sent to other nodes) and its micro-batch's
routing counts (per TP token piece too, for S1). The simulator, given only those counts and the
layout, must predict every rank's every counter exactly: token traffic, metadata, Trans / Agg of
the balancers' replicas (FasterMoE, Pro-Prophet: their own plans), SAA's phased exchange, the
smart schedule's pairwise steps, and for the vExpert balancers (EPLB, FlexMoE) the replica
gradient sum, the decision's window all-reduce and the moves between two steps.

Whole iterations (fp32, and bf16 where the name says so): the Trainer (GPT, 4 processes, a node per 2 ranks) on pipeline 2 x expert 2 (1F1B
on an uneven split with dense layers; 1F1B with `optimizer.distributed` in small buckets overlapped with
backward, and one stage of expert 2 with `optimizer.overlap_grad_reduce` (the side channels); interleaved 1F1B over 2
virtual stages on an uneven split with S2 + FasterMoE and `optimizer.distributed`) and on one
stage with tensor 2 x expert 2 records its routing trace; every rank's every counter of each
iteration (`train_step`: the activations between the stages, kind "pipeline", and the part to the
other node, the MoE layers, the tensor-parallel sums, the gradient sync over dp / edp / embedding or
its reduce-scatter and all-gather, the grad norm's and the losses' sums) equals the simulator's
on that trace (`Simulation.traffic`).
"""
import os
import tempfile

import numpy as np
import pytest
import torch

from megatron_moe.config import load_config
from megatron_moe.config.schema import Config
from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.parallel_state import ParallelState, RankLayout, side_channels
from megatron_moe.model.gpt import GPTMoEModel
from megatron_moe.tensor_parallel.param_meta import init_model_from_seed_
from megatron_moe.moe.layer import MoELayer
from megatron_moe.moe.schedules.base import even_split
from megatron_moe.perf.hardware import load_profile
from megatron_moe.sim.ops import inter_node_traffic_of, traffic_of
from megatron_moe.sim.runner import Simulation
from megatron_moe.training.trainer import Trainer
from tests.checkpoint_helpers import synthetic_datasets
from tests.distributed.harness import per_world_spawner, run_distributed

pytestmark = pytest.mark.distributed
PROFILE = "configs/hardware/cpu_gloo_2proc.yaml"
B, S, H, FFN, E = 2, 6, 8, 16, 4
RUNS = [  # (schedule, saa, balancer, smart, capacity_factor)
    ("baseline", False, "none", False, None), ("baseline", False, "fastermoe", False, 1.0),
    ("s1", False, "proprophet", False, None), ("s2", False, "none", False, 1.0),
    ("s2", True, "fastermoe", False, None), ("auto", True, "proprophet", False, 1.0), ("auto", False, "none", False, None),
    ("baseline", False, "fastermoe", True, None), ("s2", False, "none", True, 1.0),
    ("baseline", False, "eplb", False, None), ("s2", False, "flexmoe", False, 1.0),
]
LAYOUTS = [(2, dict(expert=2)), (4, dict(tensor=2, expert=2)), (4, dict(expert=2, expert_shard=2, ranks_per_node=2)),
           (8, dict(tensor=2, expert=2, expert_shard=2, ranks_per_node=4)), (8, dict(tensor=4, expert=2))]


def run_config(run, layout: dict) -> Config:
    schedule, saa, balancer, smart, capacity = run
    cfg = Config()
    cfg.model.hidden_size, cfg.model.seq_length, cfg.model.num_attention_heads, cfg.model.num_layers = H, S, 4, 1
    cfg.training.micro_batch_size = B
    cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.capacity_factor, cfg.moe.expert_ffn_hidden_size = E, 2, capacity, FFN
    cfg.moe.schedule, cfg.moe.saa, cfg.moe.balancer, cfg.moe.smart_schedule = schedule, saa, balancer, smart
    cfg.moe.fastermoe.min_shadow, cfg.moe.proprophet.min_replicas = 1, 1
    cfg.moe.flexmoe.interval = cfg.moe.eplb.interval = 1
    cfg.moe.flexmoe.threshold = 1.0
    cfg.parallel.tensor, cfg.parallel.expert = layout.get("tensor", 1), layout.get("expert", 1)
    cfg.parallel.expert_shard = layout.get("expert_shard", 1)
    cfg.moe.saa = saa and (schedule != "s2" or cfg.parallel.tensor > 1)  # S2 + SAA is refused at tensor 1
    cfg.perf.hardware_profile = PROFILE
    return cfg


def _step(layer, x, grad):
    C.COMM_STATS.reset()
    inp = x.clone().requires_grad_(True)
    y, aux = layer(inp)
    ((y * grad).sum() + aux).backward()
    layer.balancer.before_grad_sync()
    layer.zero_grad(set_to_none=True)
    return C.COMM_STATS.snapshot(), dict(C.COMM_STATS.inter_node)


def _real(state, jobs):
    out = []
    for kwargs in jobs:
        sub = ParallelState.build(RankLayout(world_size=state.world_size, **kwargs), state.rank,
                                  ["ep"])  # as the trainer's for fastermoe / proprophet (SIDE_CHANNELS)
        coords = sub.layout.coords(sub.rank)
        gen = torch.Generator().manual_seed(7 + coords["dp"])  # every data-parallel rank its own tokens
        x, grad = torch.randn(B, S, H, generator=gen), torch.randn(B, S, H, generator=gen)
        results = []
        for run in RUNS:
            layer = MoELayer(run_config(run, kwargs), sub, layer_index=0)
            init_model_from_seed_(layer, 3, sub)
            layer.router.logit_bias = -1.5 * torch.log(torch.arange(1, E + 1, dtype=torch.float32))  # skew
            with torch.no_grad():
                ids = layer.router(x.view(B * S, H)).expert_ids  # the routing every schedule computes
            pieces = [torch.bincount(p.flatten(), minlength=E) for p in ids.split(even_split(B * S, sub.tp_size))]
            steps, moves = [_step(layer, x, grad)], 0
            if layer.balancer.slots_per_rank is not None:  # vExperts: decide and move, then a second step
                C.COMM_STATS.reset()
                moves = layer.balancer.after_optimizer_step(1, None)
                steps += [(C.COMM_STATS.snapshot(), dict(C.COMM_STATS.inter_node)), _step(layer, x, grad)]
            results.append(dict(steps=steps, moves=moves, counts=layer.last_stats.tokens_per_expert,
                                pieces=torch.stack(pieces)))
        out.append(results)
    return out


spawn = per_world_spawner(LAYOUTS, _real)


def _per_rank(dicts, world):
    """[rank] {key: bytes} -> {key: Int[W]} without zero entries."""
    keys = sorted({k for d in dicts for k, v in d.items() if v})
    return {k: np.array([d.get(k, 0) for d in dicts], dtype=np.int64) for k in keys}


def _check(real, ops, what):
    """real: [rank] (bytes, inter-node bytes) counters; ops: the simulator's ops of the same step."""
    _compare(real, (traffic_of(ops), inter_node_traffic_of(ops)), what)


def _compare(real, predictions, what):
    """real: [rank] (bytes, inter-node bytes) counters; predictions: ({key: bytes [W]}, the same inter-node)."""
    for index, predicted in enumerate(predictions):
        expected = _per_rank([r[index] for r in real], len(real))
        predicted = {k: np.round(v).astype(np.int64) for k, v in predicted.items() if np.round(v).any()}
        assert sorted(predicted) == sorted(expected), f"{what} ({'inter-node ' if index else ''}keys)"
        for key in expected:
            np.testing.assert_array_equal(predicted[key], expected[key], err_msg=f"{what}: {key}")


@pytest.mark.parametrize("world,layout", LAYOUTS, ids=[str(kw) for _, kw in LAYOUTS])
def test_simulated_bytes_equal_the_real_counters(world, layout):
    results = spawn(world)[str(layout)]
    lay = RankLayout(world_size=world, **layout)
    profile = load_profile(PROFILE)
    for r, run in enumerate(RUNS):
        ranks = [results[q][r] for q in range(world)]
        by_dp = {lay.coords(q)["dp"]: ranks[q] for q in range(world)}
        counts = np.stack([by_dp[d]["counts"].numpy() for d in sorted(by_dp)])  # [dp, E]
        pieces = np.stack([by_dp[d]["pieces"].numpy() for d in sorted(by_dp)])  # [dp, tp, E]
        cfg = run_config(run, layout)
        cfg.parallel.ranks_per_node = layout.get("ranks_per_node")
        with tempfile.TemporaryDirectory() as tmp:
            sim = Simulation(cfg, profile, world, tmp)
            steps = [[q["steps"][i] for q in ranks] for i in range(len(ranks[0]["steps"]))]
            what = f"{run} on {layout} counts {counts.tolist()}"
            _check(steps[0], sim.layer_ops(counts, pieces), what)
            if len(steps) > 1:
                (ops,), moves, _ = sim.after_step(1, optimizer_state=False)  # one pipeline stage
                assert moves == ranks[0]["moves"] and (moves > 0 or run[2] != "eplb"), what  # EPLB always moves here
                _check(steps[1], ops, what + " moves")
                _check(steps[2], sim.layer_ops(counts, pieces), what + " step 2")


NODE = dict(ranks_per_node=2)  # a node per pipeline stage: the activations and pp / embedding sums cross nodes
PIPELINE_COMMON = ["model.seq_length=8", "model.vocab_size=125", "training.micro_batch_size=1",
                   "training.global_batch_size=8", "training.train_iters=2", "training.log_interval=1",
                   "training.eval_iters=0", "logging.tensorboard=false", "logging.routing_trace=true",
                   "moe.capacity_factor=1.0", "parallel.ranks_per_node=2", "perf.hardware_profile=" + PROFILE]
PP2_EP2 = ["parallel.pipeline=2", "parallel.expert=2"]
PIPELINE_RUNS = {  # name: (RankLayout kwargs, overrides on PIPELINE_COMMON)
    "1f1b-uneven": (dict(pipeline=2, expert=2), PP2_EP2 + ["model.num_layers=4", "parallel.pipeline_layers=[1,3]",
                                                         "moe.layer_freq=2"]),
    # ZeRO-1 in small buckets (several flat buffers per kind), reduce-scattered from the hooks on dp_side
    "1f1b-distributed": (dict(pipeline=2, expert=2), PP2_EP2 + ["model.num_layers=4", "optimizer.distributed=true",
                                                              "optimizer.grad_bucket_mb=0.01",
                                                              "optimizer.overlap_grad_reduce=true"]),
    "one-stage-overlap": (dict(expert=2), ["parallel.expert=2", "model.num_layers=2",  # dp / edp 2: both side channels
                                           "optimizer.overlap_grad_reduce=true", "optimizer.grad_bucket_mb=0.01"]),
    "interleaved-uneven-distributed": (dict(pipeline=2, expert=2), PP2_EP2 + [
        "model.num_layers=5", "parallel.pipeline_schedule=interleaved", "parallel.virtual_stages=2",
        "parallel.pipeline_layers=[2,1,1,1]", "optimizer.distributed=true", "moe.schedule=s2",
        "moe.balancer=fastermoe", "moe.fastermoe.min_shadow=1"]),
    "one-stage-tp2": (dict(tensor=2, expert=2), ["parallel.tensor=2", "parallel.expert=2", "model.num_layers=2"]),
    # bf16: activations, tokens, stage messages and the weights Trans and the ZeRO-1 all-gather send
    # in 2 bytes; main gradients (Agg, grad sync) in 4; vExpert moves in 4 (fp32 master, moments)
    "1f1b-distributed-bf16-proprophet": (dict(pipeline=2, expert=2), PP2_EP2 + [
        "model.num_layers=4", "optimizer.distributed=true", "training.precision=bf16", "moe.balancer=proprophet",
        "moe.proprophet.min_replicas=1"]),
    "one-stage-tp2-bf16-s2-saa-fastermoe": (dict(tensor=2, expert=2), [
        "parallel.tensor=2", "parallel.expert=2", "model.num_layers=2", "training.precision=bf16", "moe.schedule=s2",
        "moe.saa=true", "moe.balancer=fastermoe", "moe.fastermoe.min_shadow=1"]),
    "one-stage-ep2-bf16-flexmoe-smart": (dict(expert=2), [
        "parallel.expert=2", "model.num_layers=2", "training.precision=bf16", "moe.balancer=flexmoe",
        "moe.flexmoe.interval=1", "moe.flexmoe.threshold=1.0", "moe.smart_schedule=true",
        "moe.flexmoe.amortize_steps=100"]),  # moves nearly free, so that this short run moves experts
}


def _pipeline_config(name: str, tmp: str, runs=None):
    runs = PIPELINE_RUNS if runs is None else runs
    return load_config("configs/gpt_moe_tiny.yaml", PIPELINE_COMMON + runs[name][1] +
                       [f"training.run_dir={os.path.join(tmp, name)}"])


def _train_pipeline(state, tmp: str, runs=None):
    """Every run's per-iteration counters on this rank: {run: [(bytes, inter-node bytes)]}."""
    out = {}
    runs = PIPELINE_RUNS if runs is None else runs
    for name, (layout, _) in runs.items():
        cfg = _pipeline_config(name, tmp, runs)
        sub = ParallelState.build(RankLayout(world_size=state.world_size, **layout, **NODE), state.rank,
                                  side_channels(cfg))  # as the trainer (training/entry.py)
        trainer = Trainer(cfg, sub, GPTMoEModel, synthetic_datasets)
        counters, step = [], trainer.train_step

        def train_step(iteration, step=step, counters=counters):
            record = step(iteration)  # resets the counters first; what runs after it is no iteration's
            counters.append((C.COMM_STATS.snapshot(), dict(C.COMM_STATS.inter_node)))
            return record

        trainer.train_step = train_step
        trainer.train()
        out[name] = counters
    return out


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory):
    """(the runs' directory, [rank] {run: per-iteration counters}) from one spawn of 4 processes."""
    tmp = str(tmp_path_factory.mktemp("sim_pipeline"))
    return tmp, run_distributed(4, _train_pipeline, NODE, (tmp,), timeout=600)


@pytest.mark.parametrize("name", list(PIPELINE_RUNS))
def test_simulated_pipeline_bytes_equal_the_real_counters(pipeline_runs, name):
    """Each iteration of a real pipeline run, replayed from its routing trace."""
    check_replay(*pipeline_runs, name, PIPELINE_RUNS)


def check_replay(tmp, ranks, name, runs):
    """Every iteration of real run `name` (of `runs`), replayed: every rank's every counter equals the simulator's."""
    with tempfile.TemporaryDirectory() as work:
        sim = Simulation(_pipeline_config(name, tmp, runs), load_profile(PROFILE), 4, work)
        steps = list(sim.trace(os.path.join(tmp, name, "routing"), 0).steps())
        assert [it for it, _, micro in steps if micro is not None] == [1, 2]  # per micro-batch counts, replayed
        kinds = set()
        for i, (iteration, counts, micro) in enumerate(steps):
            result = sim.iteration(iteration, counts, micro)
            _compare([r[name][i] for r in ranks], sim.traffic, f"{name} iteration {iteration}")
            kinds |= {key.split("/")[0] for r in ranks for key, v in r[name][i][0].items() if v}
            pipelined = runs[name][0].get("pipeline", 1) > 1
            assert (0 < result.pipeline_bubble < 1 and result.pipeline_bubble_ideal > 0) == pipelined
        # the balancers' traffic ran (and was predicted): replicas, vExpert moves, the smart schedule
        wanted = {"proprophet": "trans", "fastermoe": "trans", "flexmoe": "vexpert_move", "smart": "smart_p2p"}
        assert {wanted[w] for w in name.split("-") if w in wanted} <= kinds, (name, kinds)
