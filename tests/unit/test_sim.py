"""The cluster simulator's parts (megatron_moe/sim/): profile format, world arrays, traces, the
owner-only fast path, the timeline's semantics, costs against hand formulas, the scale target
(generous bound) and the tools. Bytes against real runs: tests/distributed/test_sim_bytes.py;
a recorded trace's replay: tests/distributed/test_sim_replay.py."""
import json
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from megatron_moe.config import ConfigError, load_config
from megatron_moe.distributed.parallel_state import GROUP_NAMES, RankLayout
from megatron_moe.moe.placement import Placement
from megatron_moe.perf.alpha_beta import AlphaBeta
from megatron_moe.perf.hardware import load_profile, save_profile
from megatron_moe.sim.cluster import Cluster, decision_profile
from megatron_moe.sim.layout import STAGE_GROUPS, WorldLayout
from megatron_moe.sim.moe_layer import Executed
from megatron_moe.sim.ops import Op, OpBuilder, traffic_of
from megatron_moe.sim.replica_traffic import vexpert_grad_op
from megatron_moe.sim.results import candidate_options
from megatron_moe.sim.runner import Simulation, keep_pieces
from megatron_moe.sim.timeline import Timeline
from megatron_moe.sim.traces import RecordedTrace, SyntheticTrace, largest_remainder, split_even
from tests.doc_blocks import run_doc_command

CLUSTER = """name: c
expert_compute: {alpha: 0.0, beta: 1.0e-12}
cluster:
  node_size: 2
  links:
    all_to_all: {intra: {alpha: 1.0e-3, beta: 1.0e-6}, inter: {alpha: 2.0e-3, beta: 4.0e-6}}
    all_gather: {intra: {alpha: 1.0e-3, beta: 1.0e-6}}
    all_reduce: {intra: {alpha: 1.0e-3, beta: 2.0e-6}}
    p2p: {intra: {alpha: 1.0e-3, beta: 1.0e-6}, inter: {alpha: 2.0e-3, beta: 4.0e-6}}
"""


@pytest.fixture
def cluster_profile(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(CLUSTER)
    return str(path)


def test_cluster_profile_round_trip_and_errors(cluster_profile, tmp_path):
    profile = load_profile(cluster_profile)
    assert profile.cluster.node_size == 2 and profile.cluster.links["all_to_all"].inter.beta == 4.0e-6
    save_profile(profile, str(tmp_path / "again.yaml"))
    assert load_profile(str(tmp_path / "again.yaml")) == profile
    for bad, needle in [("cluster: {node_size: 0}", "cluster.node_size"),
                        ("cluster: {links: {magic: {intra: {alpha: 1, beta: 1}}}}", "cluster.links"),
                        ("cluster: {links: {p2p: {inter: {alpha: 1, beta: 1}}}}", "cluster.links.p2p")]:
        (tmp_path / "bad.yaml").write_text(bad)
        with pytest.raises(ConfigError, match=needle):
            load_profile(str(tmp_path / "bad.yaml"))


def test_flat_profiles_become_one_node_links_and_cluster_profiles_flat_ops(cluster_profile):
    world = WorldLayout(RankLayout(4, expert=4, ranks_per_node=2))
    flat = Cluster(load_profile("configs/hardware/parm_testbed_a.yaml"), world)
    ag = flat.profile.mp_allgather
    assert flat.links["all_reduce"].intra == AlphaBeta(2 * ag.alpha, 2 * ag.beta) and flat.links["all_gather"].inter is None
    decided = decision_profile(Cluster(load_profile(cluster_profile), world))
    # EP ranks 0 and 1 share node 0: p2p as inside a node; ep spans 2 nodes: the all-to-all's 2 of 3
    # peers are off the node, the inter link (4e-6 x 2/4 of x) outweighs the intra one (1e-6 x 1/4 of x)
    assert decided.p2p == AlphaBeta(1.0e-3, 1.0e-6)
    assert decided.ep_esp_alltoall == AlphaBeta(2.0e-3, pytest.approx(2.0e-6))
    assert decided.saa is not None


@pytest.mark.parametrize("kwargs", [dict(world_size=8, tensor=2, expert=2, expert_shard=2),
                                    dict(world_size=8, tensor=4, expert=2), dict(world_size=16, expert=4, tensor=2),
                                    dict(world_size=16, pipeline=2, tensor=2, expert=2),
                                    dict(world_size=24, pipeline=3, expert=2, expert_shard=2)])
def test_world_arrays_agree_with_rank_layout(kwargs):
    """Each pipeline stage's arrays are RankLayout's groups inside that stage, its nodes the global
    ranks' (ranks_per_node 4 or 3: with pipeline 3 the stages' node patterns differ); the groups
    across stages (pp, embedding, world) and ep_node (per rank sizes: uneven with pipeline 3) have
    RankLayout's coordinates, sizes and node spans."""
    per_node = 3 if kwargs.get("pipeline") == 3 else 4
    lay = RankLayout(**kwargs, ranks_per_node=per_node)
    for stage in range(lay.pipeline):
        world = WorldLayout(lay, stage)
        ranks = range(world.offset, world.offset + world.size)
        assert world.node.tolist() == [r // per_node for r in ranks]
        for name in GROUP_NAMES:
            groups = [lay.group_of(name, r) for r in ranks]
            assert world.coord[name].tolist() == [lay.coords(r)[name] for r in ranks], name
            assert np.broadcast_to(world.group_size[name], world.size).tolist() == [len(g) for g in groups], name
            assert world.spans_nodes[name].tolist() == [len({m // per_node for m in g}) > 1 for g in groups], name
            ids = world.group_id[name].tolist()
            assert all((ids[i] == ids[j]) == (groups[i] == groups[j]) for i in range(world.size)
                       for j in range(world.size)), name
        for name in STAGE_GROUPS:
            expected = [[r - world.offset for r in g] for g in lay.groups(name) if g[0] in ranks]
            assert world.members(name).tolist() == expected, name
            values = np.arange(world.size, dtype=float) * 7 % 5
            assert world.group_max(name, values).tolist() == [max(values[g]) for r in range(world.size)
                                                              for g in expected if r in g]


FREE_MESSAGES = """name: free
expert_compute: {alpha: 1.0e-4, beta: 1.0e-12}
cluster:
  node_size: 2
  dense_compute: {alpha: 0.0, beta: 0.0}
  links:
    all_to_all: {intra: {alpha: 1.0e-4, beta: 1.0e-8}, inter: {alpha: 2.0e-4, beta: 4.0e-8}}
    all_gather: {intra: {alpha: 1.0e-4, beta: 1.0e-8}}
    all_reduce: {intra: {alpha: 1.0e-4, beta: 2.0e-8}, inter: {alpha: 2.0e-4, beta: 4.0e-8}}
    p2p: {intra: {alpha: %s, beta: 0.0}}
"""


@pytest.mark.parametrize("stages,schedule,virtual,micro", [(2, "1f1b", 1, 4), (4, "1f1b", 1, 8),
                                                           (2, "interleaved", 2, 4), (4, "interleaved", 2, 4)])
def test_equal_stages_with_free_messages_have_the_ideal_bubble(tmp_path, stages, schedule, virtual, micro):
    """One MoE layer per model chunk, the same routing in every layer and micro-batch, dense compute
    and messages free: every stage's steps take the same time, and the simulated bubble is
    (p - 1) / (v m + p - 1). Messages that cost (p2p alpha 1 ms) only make it larger."""
    results = []
    for alpha in (0.0, 1e-3):
        path = tmp_path / f"free{alpha}.yaml"
        path.write_text(FREE_MESSAGES % alpha)
        dp, E = 2, 4
        cfg = load_config(None, [f"model.num_layers={stages * virtual}", "model.hidden_size=8", "model.seq_length=8",
                                 "model.num_attention_heads=2", f"moe.num_experts={E}", "moe.expert_ffn_hidden_size=16",
                                 "parallel.expert=2", f"parallel.pipeline={stages}",
                                 f"parallel.pipeline_schedule={schedule}", f"parallel.virtual_stages={virtual}",
                                 "training.micro_batch_size=1", f"training.global_batch_size={dp * micro}"])
        sim = Simulation(cfg, load_profile(str(path)), dp * stages, str(tmp_path))
        assert sim.micro_batches == micro
        rows = micro * 8 * 2  # micro-batches x tokens x top-2
        results.append(sim.iteration(1, np.full((stages * virtual, dp, E), rows // E)))
    free, costly = results
    ideal = (stages - 1) / (virtual * micro + stages - 1)
    assert free.pipeline_bubble_ideal == pytest.approx(ideal)
    assert free.pipeline_bubble == pytest.approx(ideal, rel=1e-9)
    assert costly.pipeline_bubble > free.pipeline_bubble and costly.seconds > free.seconds
    assert free.breakdown["pipeline/idle"][0] > 0 and free.bytes_by_kind["pipeline"] > 0


def test_owner_only_fast_path_equals_the_placement():
    rng = np.random.default_rng(0)
    for sources, experts, ep in [(4, 8, 4), (8, 16, 2), (3, 6, 3)]:
        counts = rng.integers(0, 50, size=(sources, experts))
        fast, real = Executed.owner_only(counts, ep), Executed.of(Placement.owner_only(torch.from_numpy(counts), ep))
        for field in ("rows", "per_rank", "counts"):
            np.testing.assert_array_equal(getattr(fast, field), getattr(real, field))
        assert fast.replicas == real.replicas and fast.num_replicas == real.num_replicas == 0


def test_synthetic_traces(tmp_path):
    drift = SyntheticTrace("drift:1.2:0.05", num_layers=2, num_sources=8, num_experts=16, rows=512, iterations=60)
    steps = list(drift.steps())
    assert len(steps) == 60 and all((c.sum(-1) == 512).all() and c.shape == (2, 8, 16) for _, c, _ in steps)
    share = np.stack([c.sum(1) / c.sum((1, 2))[:, None] for _, c, _ in steps])  # [I, L, E]
    near = np.abs(share[1:] - share[:-1]).sum(-1).mean()
    far = np.abs(share[50:] - share[:10]).sum(-1).mean()
    assert near < far  # locality: adjacent iterations alike, the hot experts move over time
    zipf = next(SyntheticTrace("zipf:1.5", 1, 4, 8, 1000, 1).steps())[1]
    assert zipf.sum((0, 1)).max() > 3 * zipf.sum((0, 1)).mean()
    with pytest.raises(ValueError, match="uniform, zipf:S or drift:S:D"):
        SyntheticTrace("zipf", 1, 1, 4, 10, 1)
    np.testing.assert_array_equal(split_even(np.array([[5, 2]]), 2), [[[3, 1], [2, 1]]])
    np.testing.assert_array_equal(largest_remainder(np.array([[1, 1, 2]]), 7), [[2, 2, 3]])
    # pieces before drops -> kept: capacity 4 over the micro-batch, by position
    np.testing.assert_array_equal(keep_pieces(np.array([[[3, 1], [3, 2]]]), 4), [[[3, 1], [1, 2]]])


def test_recorded_traces_map_onto_the_layout(tmp_path):
    from megatron_moe.moe.routing_trace import RoutingTraceWriter

    writer = RoutingTraceWriter(str(tmp_path), {"num_moe_layers": 1, "moe_layer_indices": [0], "num_sources": 2,
                                                "num_experts": 4, "top_k": 1, "tokens_per_iteration": 16})
    micro = np.array([[[[1, 2, 3, 2], [4, 0, 0, 4]], [[2, 2, 2, 2], [0, 8, 0, 0]]]])  # [L, S, M, E]
    writer.append(1, micro.sum(2), np.zeros((1, 2)), micro)
    writer.close()
    _, counts, exact = next(RecordedTrace(str(tmp_path), 2, 16, 4).steps())
    np.testing.assert_array_equal(exact, micro)  # as recorded: per micro-batch
    _, split, none = next(RecordedTrace(str(tmp_path), 4, 8, 4).steps())  # twice the sources
    assert none is None and split.shape == (1, 4, 4) and (split.sum(-1) == 8).all()
    _, merged, _ = next(RecordedTrace(str(tmp_path), 1, 10, 4).steps())  # summed, rescaled to 10 rows
    assert merged.sum() == 10 and merged.shape == (1, 1, 4)
    with pytest.raises(ValueError, match="3 data-parallel ranks"):
        RecordedTrace(str(tmp_path), 3, 8, 4)


def _world(cluster_profile, world_size=4, **kwargs):
    world = WorldLayout(RankLayout(world_size, **kwargs))
    return world, OpBuilder(world, Cluster(load_profile(cluster_profile), world))


def test_timeline_semantics(cluster_profile):
    world, b = _world(cluster_profile, expert=2, ranks_per_node=1)
    slow = b.compute("work", np.array([1e12, 3e12, 1e12, 1e12]))  # 1 s, 3 s, 1 s, 1 s
    a2a = b.exchange("dispatch", "all_to_all", "ep", np.full((2, 2, 2), 1000.0), 4, a2a=True)
    t = Timeline(world)
    t.run([slow, a2a], "moe0")
    # the all-to-all starts when its group's slowest member is ready (ep groups {0, 1}, {2, 3}); one
    # rank per node: the inter link, 1000 elements each way
    assert t.clock.tolist() == pytest.approx([3 + 6e-3, 3 + 6e-3, 1 + 6e-3, 1 + 6e-3])
    # an asynchronous transfer hides behind compute, and is waited for only when needed
    t = Timeline(world)
    t.register("h", "moe0", [Op("trans", "issue", lambda k: np.full(4, 0.5), "ep", handle="t")])
    t.run([b.mark("h"), b.compute("c", np.full(4, 2e11)), b.wait("trans", "t")], "moe0")
    assert t.clock.tolist() == pytest.approx([0.5] * 4)
    assert t.breakdown(0)[("moe0", "trans")] == pytest.approx((0.3, 0.5))  # 0.3 s exposed of 0.5
    # Lancet: the weight-gradient half of backward compute runs inside the backward all-to-all
    t = Timeline(world, defer_wgrad=True)
    t.run([b.compute("experts", np.full(4, 4e-3 * 1e12), deferrable=0.5), a2a], "moe0", backward=True)
    t.end_backward()
    assert t.clock.tolist() == pytest.approx([2e-3 + 6e-3] * 4)  # 2 ms dX, the 2 ms dW inside the 6 ms all-to-all
    assert t.breakdown(0)[("moe0", "dw_overlap")] == pytest.approx((2e-3, 0.0))  # Lancet's "overlap"


def test_vexpert_gradient_sum_among_holders_by_hand(cluster_profile):
    """`sync_replica_grads` priced as it runs: 4 EP ranks, 2 per node, 1000 fp32 elements per
    expert. Expert 0 on ranks 0 and 1: chunks [0, 500) summed on rank 0, [500, 1000) on rank 1.
    Expert 1 on ranks 0, 1, 2: chunks of 334, 333, 333 summed on holders (1 + j) mod 3 = ranks
    1, 2, 0. Rank 3 holds no replicated expert."""
    world, b = _world(cluster_profile, expert=4, ranks_per_node=2)
    ops = vexpert_grad_op(b, np.array([[0, 1], [1, 0], [2, 1], [3, -1]]), 4, 1000)
    # round 1 (elements): 0 -> 1: 500 + 334, 0 -> 2: 333, 1 -> 0: 500 + 333, 1 -> 2: 333, 2 -> 0: 333,
    # 2 -> 1: 334; round 2 the transpose
    sent = [834 + 333 + 833 + 333, 833 + 333 + 834 + 334, 333 + 334 + 333 + 333, 0]
    assert traffic_of(ops)["vexpert_grad/ep"].tolist() == [4 * x for x in sent]
    t = Timeline(world)
    t.run(ops, "iteration")

    def p2p(on, off):  # the larger of the node link's and the inter-node link's time
        return max(1e-3 + 1e-6 * on if on else 0.0, 2e-3 + 4e-6 * off if off else 0.0)

    # per round: rank 0 834 on its node / 333 off it, rank 1 834 / 334, rank 2 0 / 667 (the
    # larger of sent and received); rank 3 neither spends nor waits
    expected = [2 * p2p(834, 333), 2 * p2p(834, 334), 2 * p2p(0, 667), 0.0]
    assert t.clock.tolist() == pytest.approx(expected)
    assert vexpert_grad_op(b, np.array([[0, 1], [2, -1], [3, -1], [-1, -1]]), 4, 1000) == []  # no replica


def test_one_layer_times_by_hand(cluster_profile, tmp_path):
    """2 ranks on one node, expert 2, top-1, 2 experts, hidden 8, ffn 16, 8 tokens each: every
    token of rank 0 to expert 1 and of rank 1 to expert 0, dropless, no TP."""
    overrides = ["model.num_layers=1", "model.hidden_size=8", "model.num_attention_heads=2", "model.seq_length=8",
                 "moe.num_experts=2", "moe.top_k=1", "moe.expert_ffn_hidden_size=16", "parallel.expert=2",
                 "training.micro_batch_size=1", "training.global_batch_size=2"]
    sim = Simulation(load_config(None, overrides), load_profile(cluster_profile), 2, str(tmp_path))
    counts = np.array([[0, 8], [8, 0]])
    flops = 8 * 2 * 8 * 16 * 2 * 1e-12  # 8 rows x 2 h f x 2 matrices, 1e-12 s per FLOP
    a2a = 1e-3 + 1e-6 * 8 * 8  # 8 rows of 8 elements to the other rank (one node)
    counts_gather = 1e-3 + 1e-6 * 2 * 2 * 2  # E int64 counts (2 fp32 elements' bytes each) from each of 2 ranks
    expected = counts_gather + 4 * a2a + 3 * flops  # forward: 2 all-to-alls, experts; backward: 2 x experts
    assert sim.layer_seconds(counts) == pytest.approx(expected)
    # bf16: the tokens' bytes halve, the profile's beta is per fp32 element's 4 bytes
    bf16 = Simulation(load_config(None, overrides + ["training.precision=bf16"]), load_profile(cluster_profile), 2,
                      str(tmp_path / "bf16"))
    assert bf16.layer_seconds(counts) == pytest.approx(counts_gather + 4 * (1e-3 + 1e-6 * 8 * 8 / 2) + 3 * flops)


def test_node_deduplicated_dispatch_is_refused_in_one_line(cluster_profile, tmp_path):
    """Its rows depend on which of a token's experts share a node, which no trace holds."""
    with pytest.raises(ConfigError) as e:
        Simulation(load_config(None, ["moe.token_dispatch=node_dedup"]), load_profile(cluster_profile), 2, str(tmp_path))
    assert str(e.value).startswith("moe.token_dispatch=node_dedup: the simulator models per_copy only")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("balancer,iterations", [("none", 20), ("fastermoe", 5), ("proprophet", 5), ("eplb", 11),
                                                  ("flexmoe", 11)])
def test_scale_target_with_a_generous_bound(balancer, iterations, one_thread):
    """1024 simulated GPUs, 256 experts, every balancer (the vExpert ones decide at iteration 10):
    under 1 s of CPU time per iteration (one thread; other jobs on the cores do not count), a
    generous bound (the benchmark's target is 0.3 s per iteration: 100 in < 30 s on an idle
    machine, benchmarks/simulate_scale.py). The vExpert planners get 1.5 s: CPU time still grows
    when the suite's other worker shares the cores (FlexMoE's 11 iterations: 8.9 s alone, 11.7 s
    in a full suite run on 2026-11-27)."""
    sys.path.insert(0, "benchmarks")
    import simulate_scale

    profile = load_profile("configs/hardware/flexmoe_azure_a100.yaml")
    start = time.process_time()  # this process's CPU time: other jobs on the cores do not count
    result = simulate_scale.measure(balancer, 1024, iterations, profile)
    per_iteration = 1.5 if balancer in ("flexmoe", "eplb") else 1.0
    assert time.process_time() - start < per_iteration * iterations and result["predicted_iteration_ms"] > 0
    if balancer == "none":
        assert all(b > 1.5 for b in result["balance_ratio"])  # Zipf routing on 64 EP ranks is imbalanced


def test_candidate_options_cover_every_technique():
    options = candidate_options(tensor=2)
    assert len(options) == len(set(map(tuple, options))) == 6 * 6 * 2 * 2 - 2 * 6 * 2  # no smart with SAA
    for needle in ("moe.schedule=auto", "moe.saa=true", "moe.balancer=eplb", "moe.proprophet.overlap=true",
                   "moe.smart_schedule=true", "moe.lancet.defer_wgrad=true"):
        assert any(needle in option for option in options), needle
    # without MP, Parm's schedules are the baseline: each balancer x smart x dW once
    no_mp = candidate_options(tensor=1)
    assert len(no_mp) == 6 * 2 * 2 and all(o[0] == "moe.schedule=baseline" and "moe.saa=true" not in o for o in no_mp)


def test_simulate_cli_recommends_and_writes_plots(tmp_path):
    options = ["moe.schedule=baseline", "moe.schedule=s2,moe.balancer=fastermoe", "moe.schedule=s1,moe.saa=true",
               "moe.balancer=proprophet moe.proprophet.overlap=true", "parallel.pipeline=2",
               "parallel.pipeline=2 parallel.pipeline_schedule=interleaved parallel.virtual_stages=2"]
    proc = subprocess.run([sys.executable, "tools/simulate.py", "--config", "configs/gpt_moe_tiny.yaml",
                           "parallel.expert=4", "parallel.tensor=2", "model.num_layers=4",
                           "training.global_batch_size=16", "--hardware", "configs/hardware/parm_testbed_b.yaml",
                           "--gpus", "16", "--trace", "zipf:1.2", "--iterations", "2", "--recommend",
                           "--out", str(tmp_path)] + [arg for o in options for arg in ("--option", o)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert list(out["skipped"]) == ["moe.schedule=s1,moe.saa=true"]  # a config rule: SAA needs s2 or auto
    assert "moe.saa=true needs moe.schedule s2 or auto" in out["skipped"]["moe.schedule=s1,moe.saa=true"]
    times = [out["summary"][name]["iteration_ms"] for name in out["ranking"]]
    assert times == sorted(times) and len(times) == 5
    # pipeline options are ranked with their bubble: m = 2 micro-batches per rank on 2 stages
    bubbles = {name: out["summary"][name]["pipeline_bubble"] for name in out["ranking"]}
    assert bubbles["moe.schedule=baseline"] == 0 and bubbles["parallel.pipeline=2"] > 1 / 3
    assert bubbles["parallel.pipeline=2,parallel.pipeline_schedule=interleaved,parallel.virtual_stages=2"] > 1 / 5
    assert out["recommended"] == out["ranking"][0].split(",")
    assert f"recommended overrides: {' '.join(out['recommended'])}" in proc.stdout
    for png in ("iteration_time.png", "breakdown.png", "balance_ratio.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ranking"] == out["ranking"]


def test_reproduce_papers_writes_the_document(tmp_path):
    """tools/reproduce_papers.py (--quick: a few configurations), the README's command: the paper's
    figure, ours, the ratio and the trend checks per experiment, and the numbers as JSON."""
    out = tmp_path / "reproduce.md"
    proc = run_doc_command("README.md", "tools/reproduce_papers.py", "--quick", "--out", out, cwd=tmp_path, timeout=300)
    doc = out.read_text()
    for needle in ("## Parm Table IV", "| S1 | 2 | 2 | A8 | 2.10x |", "## Lancet Fig. 13", "up to 83%",
                   "Trends (the paper's claim", "What differs and why", "## Summary", "## FlexMoE Fig. 5",
                   "FlexMoE's moves ms: exposed / total", "## Pro-Prophet Tables IV-V", "MoE layers' share",
                   "## FasterMoE Fig. 13", "## Parm S2 + SAA with each balancer"):
        assert needle in doc, needle
    numbers = json.loads(proc.stdout.strip().splitlines()[-1])
    assert numbers["parm"]["S1 mp4 esp4 A8"] > numbers["parm"]["S1 mp2 esp2 A8"] > 1  # S1 beats the baseline
    assert all(v["cut_a2a"] > 0 for v in numbers["lancet"].values())
    # FlexMoE as its paper runs it: best-effort moves land in the next iteration, partly hidden
    for v in numbers["flexmoe"].values():
        exposed, hidden = v["vexpert_move_ms"]
        assert v["vexpert_transfers"] > 0 and exposed > 0 and hidden > 0
        assert v["balance_ratio"]["flexmoe"] < v["balance_ratio"]["fastermoe"] + 0.5 and v["replicas"] > 0
    for v in numbers["proprophet"].values():  # the balancers balance, DeepSpeed-MoE does not
        ratios = v["balance_ratio"]
        assert ratios["Pro-Prophet"] < ratios["FasterMoE"] <= ratios["DeepSpeed-MoE"] and 0 < v["moe_share"] < 1
    # --quick: johnny (16 GPUs) only; shadowing and the smart schedule each speed the MoE layers up
    assert all(numbers["fastermoe"][f"johnny {name}"]["mean"] > 1 for name in ("shadowing", "smart", "both"))
    combined = numbers["combination"]  # S2 + SAA beats the baseline schedule, and a balancer S2 + SAA alone
    assert combined["S2+SAA"]["iteration_ms"] < combined["baseline schedule"]["iteration_ms"]
    assert combined["S2+SAA + proprophet"]["balance_ratio"] < combined["S2+SAA"]["balance_ratio"]


def test_best_effort_moves_expose_what_the_forward_before_their_layer_leaves(cluster_profile, tmp_path):
    """`moe.flexmoe.moves: best_effort` in the simulator: a layer's round, issued at the start of the
    next iteration behind the rounds of the layers before it on one side channel, exposes
    max(0, when it ends - the work before its layer's forward). 2 ranks, 2 MoE layers, no
    decisions (threshold 1000): the rounds are injected with known durations."""
    overrides = ["model.num_layers=2", "model.hidden_size=8", "model.num_attention_heads=2", "model.seq_length=8",
                 "model.vocab_size=64", "moe.num_experts=2", "moe.top_k=1", "moe.expert_ffn_hidden_size=16",
                 "moe.layer_freq=1", "parallel.expert=2", "training.micro_batch_size=1",
                 "training.global_batch_size=2", "moe.balancer=flexmoe", "moe.flexmoe.moves=best_effort",
                 "moe.flexmoe.threshold=1000"]
    sim = Simulation(load_config(None, overrides), load_profile(cluster_profile), 2, str(tmp_path))
    counts = np.array([[[3, 5], [6, 2]]] * 2)  # [layers, dp, E]
    plain = sim.iteration(1, counts).seconds
    stage = sim.stages[0]
    before = Timeline(stage.world)  # the work before layer 0's forward: embedding, layer 0's attention
    before.run(stage.dense.embedding()[0] + stage.dense.attention()[0], "x")
    w0 = float(before.clock.max())
    assert np.allclose(before.clock, w0) and 0 < w0 < plain

    def round_of(i, seconds):
        return [Op("vexpert_move", "issue", lambda k: np.full(2, seconds), "ep", handle=f"vexpert_move{i}")]

    def run(t0, t1):
        sim.in_flight = {i: round_of(i, t) for i, t in enumerate((t0, t1)) if t is not None}
        r = sim.iteration(2, counts)
        return r.seconds, [r.breakdown.get(f"moe{i}/vexpert_move", [0.0, 0.0])[:2] for i in range(2)]

    exact = lambda x: pytest.approx(x, rel=1e-9, abs=1e-15)  # the times differ by ~w0 (1e-8 s) in ~1e-2 s
    seconds, parts = run(0.5 * w0, None)  # hidden behind the embedding and the attention
    assert seconds == exact(plain) and parts[0] == exact([0.0, 0.5 * w0])
    for t0 in (2.0 * w0, 5.0 * plain):  # longer than that work: the rest is exposed, once
        seconds, parts = run(t0, None)
        assert parts[0] == exact([t0 - w0, t0]) and seconds == exact(plain + t0 - w0)
    # layer 1's round queues behind layer 0's: it ends at t0 + t1; layer 1's forward starts after
    # layer 0's wait (t0) and the work between (layer 0's MoE forward, layer 1's attention: ~3 ms here)
    seconds, parts = run(2.0 * w0, 1e-9)
    assert parts[1] == exact([0.0, 1e-9])  # hidden behind that work
    for t1 in (2.0 * plain, 4.0 * plain):
        seconds_1, parts = run(2.0 * w0, t1)
        between = t1 - parts[1][0]  # the work between the two waits, which hid part of t1
        assert parts[0] == exact([w0, 2.0 * w0]) and parts[1][1] == exact(t1)
        assert 0.1 * plain < between < 0.5 * plain and seconds_1 == exact(seconds + t1 - between)
    t = Timeline(stage.world)  # and independently: the arithmetic on a bare timeline
    t.issue_in_order([("a", round_of(0, 0.4)), ("b", round_of(1, 0.3))])
    t.run([stage.b.compute("work", np.full(2, 0.5e12)), stage.b.wait("vexpert_move", "vexpert_move0")], "a")
    t.run([stage.b.compute("work", np.full(2, 0.1e12)), stage.b.wait("vexpert_move", "vexpert_move1")], "b")
    assert t.clock.tolist() == pytest.approx([0.7, 0.7])  # 0.4 + 0.3 queued, 0.6 of work before the second wait
    assert t.breakdown(0)[("a", "vexpert_move")] == pytest.approx((0.0, 0.4))
    assert t.breakdown(0)[("b", "vexpert_move")] == pytest.approx((0.1, 0.3))


def test_best_effort_moves_change_when_the_moves_cost_not_what_they_do(cluster_profile, tmp_path):
    """The same FlexMoE decisions with sync and best-effort moves (drifting routing, 4 ranks): the
    same balance, primitives, transfers and bytes per iteration; a sync round is exposed at the end
    of its iteration, a best-effort one lands in the next and exposes at most its duration."""
    overrides = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=2", "model.seq_length=64",
                 "model.vocab_size=64", "moe.num_experts=8", "moe.top_k=2", "moe.layer_freq=1",
                 "parallel.expert=4", "training.micro_batch_size=4", "training.global_batch_size=16",
                 "moe.balancer=flexmoe", "moe.flexmoe.threshold=1.0", "moe.flexmoe.amortize_steps=1000"]
    runs = {}
    for moves in ("sync", "best_effort"):
        sim = Simulation(load_config(None, overrides + [f"moe.flexmoe.moves={moves}"]), load_profile(cluster_profile),
                         4, str(tmp_path / moves))
        runs[moves] = sim.run(sim.trace("drift:1.5:0.3", 8, seed=1).steps(), limit=8)
    sync, best = runs["sync"], runs["best_effort"]
    assert sum(r.vexpert_transfers for r in sync) > 2  # it moved, more than once
    for a, b in zip(sync, best):
        assert [layer.balance_ratio for layer in a.layers] == [layer.balance_ratio for layer in b.layers]
        assert (a.vexpert_moves, a.vexpert_transfers) == (b.vexpert_moves, b.vexpert_transfers)
        assert a.bytes_by_kind.get("vexpert_move", 0) == b.bytes_by_kind.get("vexpert_move", 0)
        assert ("iteration/vexpert_move" in a.breakdown) == (a.vexpert_transfers > 0)
        assert not any(key.startswith("moe") and key.endswith("/vexpert_move") for key in a.breakdown)
        assert "iteration/vexpert_move" not in b.breakdown
    for before, b in zip(best, best[1:]):  # a round decided after iteration t lands in t + 1
        landed = [v for key, v in b.breakdown.items() if key.endswith("/vexpert_move")]
        assert bool(landed) == (before.vexpert_transfers > 0)
        assert all(0 <= exposed <= duration + 1e-15 for exposed, duration, _ in landed)
