"""FlexMoE's straggler-relative policy maker (techniques/flexmoe/flexmoe_policy.py) and the issue-30
acceptance: FlexMoE and EPLB driven the way training drives them (the simulator calls the
balancers' own `plan` / `observe` / `decide`) on skewed and drifting Zipf routing, on the FlexMoE
testbed profile. Balance ratio = max rank rows / mean rank rows of a layer's forward."""
import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from megatron_moe.config import ConfigError, load_config
from megatron_moe.config.validate import validate_config
from megatron_moe.techniques.flexmoe.flexmoe_plan import (Expand, FlexCostModel, Migrate, StepCosts, _delta, apply_ops,
                                                     make_scheduling_plan, schedule, vexpert_counts)
from megatron_moe.techniques.eplb.eplb_plan import rebalance
from megatron_moe.techniques.flexmoe.flexmoe_policy import amortize_steps, escape_plan, straggler_plan
from megatron_moe.perf.hardware import load_profile
from megatron_moe.sim.runner import Simulation

COMPUTE_ONLY = FlexCostModel(seconds_per_token=1.0)
PROFILE = "configs/hardware/flexmoe_azure_a100.yaml"


def test_step_costs_equal_the_cost_model_before_and_after_plans():
    rng = np.random.default_rng(0)
    model = FlexCostModel(seconds_per_token=1.0, seconds_per_token_sent=0.3, seconds_per_param_sent=0.01,
                          params_per_expert=50, state_params_per_expert=150, amortize_steps=5)
    for _ in range(40):
        G, V, E = 4, 3, int(rng.integers(2, 9))
        slots = np.full((G, V), -1)
        slots.flat[rng.permutation(G * V)[:E]] = np.arange(E)
        counts = rng.integers(0, 50, size=(G, E)).astype(float)
        steps = StepCosts(model, counts, slots)
        np.testing.assert_allclose(steps.times, model.rank_times(counts, slots), rtol=1e-12)
        ops = straggler_plan(counts, slots, model)
        if ops:
            np.testing.assert_allclose(steps.times_after(_delta(ops, slots, G)),
                                       model.rank_times(counts, apply_ops(slots, ops)), rtol=1e-12)


def test_straggler_policy_expands_what_the_printed_alg2_cannot():
    # tests/unit/test_flexmoe_plan.py's case: e0 = expert 1 (cap 11) is not on the slowest GPU 3
    # (9 + 10 = 19), so Alg. 2 as printed returns {}. The straggler's hottest expert is 0 (cap 10):
    # a third vExpert on the idle GPU 2 would give 9 + 20 / 3; exchanging GPU 3's vExpert of it with
    # GPU 2's expert 2 (1 token) does better: GPUs [10, 11, 10, 10]
    slots = np.array([[0, -1], [1, -1], [2, -1], [3, 0]])
    counts = np.array([[5, 3, 1, 2], [5, 3, 0, 2], [5, 3, 0, 2], [5, 2, 0, 3]])
    assert make_scheduling_plan(counts, slots, COMPUTE_ONLY) == []
    assert straggler_plan(counts, slots, COMPUTE_ONLY) == [Migrate(0, 3, 1, 2, 0)]
    assert COMPUTE_ONLY.rank_times(counts, apply_ops(slots, [Migrate(0, 3, 1, 2, 0)])).tolist() == [10, 11, 10, 10]
    # with a move costing 9 s, only the free plan is left: a second vExpert of expert 0 on GPU 0,
    # next to its copy there (shared weights, §3.2): GPUs [40 / 3, 11, 1, 9 + 20 / 3]
    costly = FlexCostModel(seconds_per_token=1.0, seconds_per_param_sent=1.0, state_params_per_expert=9)
    assert straggler_plan(counts, slots, costly) == [Expand(0, 0, 0, 1)]
    ops = schedule(counts, slots, COMPUTE_ONLY, 1.0, straggler_plan)
    assert COMPUTE_ONLY.step_time(counts, apply_ops(slots, ops)) <= 11
    assert vexpert_counts(apply_ops(slots, ops), 4).sum(0).min() >= 1

def test_straggler_policy_migrates_an_unreplicated_expert_and_evacuates_for_a_hot_one():
    # no free slot: the straggler (GPU 0: experts 0 and 1, 10 + 6 tokens) swaps a vExpert of its own
    # with the idle GPU 2's expert 4 (1 token): a general Migrate, not a consolidation of replicas
    slots = np.array([[0, 1], [2, 3], [4, 5]])
    counts = np.array([[10, 6, 3, 3, 1, 1], [0] * 6, [0] * 6])
    # (or expert 0 with it: 1 + 6 | 10 + 1, the same 11; the hotter goes first)
    assert straggler_plan(counts, slots, COMPUTE_ONLY) == [Migrate(0, 0, 0, 2, 0)]
    # a hot expert (12 tokens) whose next vExpert (6) is larger than any GPU's spare time: GPU 1's
    # two small experts move into free slots first, then it takes a vExpert of expert 0
    slots = np.array([[0, -1, -1], [1, 2, -1], [3, -1, -1], [4, -1, -1]])
    counts = np.array([[12, 3, 3, 5, 5], [0] * 5, [0] * 5, [0] * 5])
    ops = straggler_plan(counts, slots, COMPUTE_ONLY)
    assert [type(op).__name__ for op in ops][-1] == "Expand" and ops[-1].expert == 0
    assert COMPUTE_ONLY.step_time(counts, apply_ops(slots, ops)) < 12


# the cost model `FlexMoE` builds for hidden 1024, FFN 4096 on the FlexMoE testbed profile (PROFILE):
# a token's forward + backward through one expert 0.36 us, one all-to-all of a token 0.11 us, a
# replicated expert's gradient sum 0.9 ms, a move (weights + 2 Adam moments) 2.7 ms over
# 5 steps (the default amortize_steps was 5 when these cases were worked out)
H, F, BETA = 1024, 4096, 1.067e-10
TESTBED = FlexCostModel(seconds_per_token=3 * 4 * H * F * 7.123e-15, seconds_per_token_sent=H * BETA,
                        seconds_per_param_sent=BETA, params_per_expert=2 * H * F, state_params_per_expert=6 * H * F,
                        amortize_steps=5)
OWNERS_8_ON_4 = np.array([[0, 1, -1], [2, 3, -1], [4, 5, -1], [6, 7, -1]])  # E/ep + 1 slots per GPU


def test_escape_leaves_a_fixed_point_eplb_beats_by_24_percent():
    # 8 experts on 4 GPUs, every GPU's gate sending the same loads; expert 3 has 52% of the tokens
    counts = np.tile([3300, 700, 1500, 17000, 1200, 900, 6000, 2100], (4, 1))
    eplb = rebalance(counts.sum(0), 4, 3)[0]  # expert 3 on all 4 GPUs, 6 on two
    assert eplb.tolist() == [[0, 1, 3], [3, 4, 6], [3, 5, 6], [2, 3, 7]]
    best = TESTBED.step_time(counts, eplb)
    # the local search alone: expert 3 on 2 GPUs (17000 tokens each); a third vExpert (11333) fits
    # on no GPU, and none can be cleared for it by plans that each gain
    local = apply_ops(OWNERS_8_ON_4, schedule(counts, OWNERS_8_ON_4, TESTBED, 1.0, straggler_plan))
    assert local.tolist() == [[3, 1, -1], [5, 3, -1], [4, 2, 0], [6, 7, -1]]
    assert straggler_plan(counts, local, TESTBED) == []
    assert TESTBED.step_time(counts, local) / best == pytest.approx(1.239, abs=1e-3)
    # the escape's kick: a third vExpert of e0 = expert 3 in GPU 3's free slot (Eq. 5 there 22.2
    # -> 34.0 ms; the kick onto GPU 2, the least loaded, does not pay); 4 straggler plans bring
    # the max from 23.0 to 19.0 ms, + 5 moves x 2.7 ms / 5 steps < 23.0
    ops = escape_plan(counts, local, TESTBED)
    assert ops[0] == Expand(3, 0, 3, 2) and len(ops) == 1 + 4
    assert TESTBED.predicted_time(counts, local, ops) < TESTBED.step_time(counts, local)
    # Alg. 1 with the escape (FlexMoE's default) ends at EPLB's placement, up to the GPUs' order
    ended = apply_ops(OWNERS_8_ON_4, schedule(counts, OWNERS_8_ON_4, TESTBED, 1.0, straggler_plan, escape_plan))
    assert sorted(sorted(row) for row in ended.tolist()) == sorted(eplb.tolist())
    assert TESTBED.step_time(counts, ended) <= best * (1 + 1e-9)
    # EPLB's placement is a fixed point of both
    assert straggler_plan(counts, eplb, TESTBED) == [] and escape_plan(counts, eplb, TESTBED) == []
    # a move paid back over 3 steps does not pay: the local fixed point stays
    dear = dataclasses.replace(TESTBED, amortize_steps=3)
    assert schedule(counts, OWNERS_8_ON_4, dear, 1.0, straggler_plan, escape_plan) == \
        schedule(counts, OWNERS_8_ON_4, dear, 1.0, straggler_plan)


def test_a_fixed_point_the_escape_does_not_leave():
    # documented in flexmoe_policy.py: e0 (expert 6, 24000 tokens on its one vExpert) is kicked,
    # but what would gain is a fourth vExpert of expert 3 and a second of 6 together: 9% above EPLB
    counts = np.tile([3000, 1000, 1500, 17000, 1000, 1000, 6000, 2000], (4, 1))
    eplb = rebalance(counts.sum(0), 4, 3)[0]
    ended = apply_ops(OWNERS_8_ON_4, schedule(counts, OWNERS_8_ON_4, TESTBED, 1.0, straggler_plan, escape_plan))
    assert ended.tolist() == [[2, 1, 3], [0, 3, -1], [7, 5, 3], [6, 4, -1]]
    assert escape_plan(counts, ended, TESTBED) == []
    assert TESTBED.step_time(counts, ended) / TESTBED.step_time(counts, eplb) == pytest.approx(1.088, abs=1e-3)


@pytest.mark.parametrize("seed", range(2))
def test_escape_invariants_random(seed):
    # Alg. 1 with the escape: valid ops, every expert keeps a vExpert, Eq. 5 never ends higher
    rng = np.random.default_rng(seed)
    for _ in range(15):
        G, V, E = 4, 3, 8
        slots = np.full((G, V), -1)
        slots.flat[rng.permutation(G * V)[:E]] = np.arange(E)
        counts = (rng.zipf(1.5, size=(G, E)) * 500).astype(float)
        ops = schedule(counts, slots, TESTBED, 1.0, straggler_plan, escape_plan)
        after = apply_ops(slots, ops)
        assert vexpert_counts(after, E).sum(0).min() >= 1
        assert TESTBED.step_time(counts, after) <= TESTBED.step_time(counts, slots)


def test_amortize_steps_default():
    # docs/balancers.md's sweep (tools/simulate.py, GPT-MoE-S and BERT-MoE-L on drifting routing):
    # and benchmarks/simulate_scale.py (issue 30's criterion, which 5 misses): the default charges a
    # 2.7 ms move 0.27 ms per step in Alg. 2's test, not 0.027 ms
    fm = load_config(None, ["moe.balancer=flexmoe"]).moe.flexmoe
    assert fm.amortize_steps is None and amortize_steps(fm) == 10
    interval = load_config(None, ["moe.balancer=flexmoe", "moe.flexmoe.trigger=interval",
                                  "moe.flexmoe.interval=25"]).moe.flexmoe
    assert amortize_steps(interval) == 25
    assert amortize_steps(load_config(None, ["moe.flexmoe.amortize_steps=7"]).moe.flexmoe) == 7


def test_flexmoe_reports_net_primitives(tmp_path):
    # the balancer's own decision (`FlexMoE.propose`: what vexpert_moves / vexpert_ops_total count)
    # on tests/unit/test_flexmoe_plan.py's case, with an idle expert 3 added: Alg. 2 as printed
    # expands expert 0 onto GPU 1 and shrinks it there later in the same decision
    cfg = load_config(None, ["model.num_layers=1", "model.hidden_size=64", "model.num_attention_heads=2",
                             "model.seq_length=64", "moe.num_experts=4", "moe.layer_freq=1", "parallel.expert=2",
                             "training.micro_batch_size=2", "training.global_batch_size=4", "moe.balancer=flexmoe",
                             "moe.flexmoe.policy=printed", "moe.flexmoe.slots_per_rank=3", "moe.flexmoe.threshold=1.0"])
    flexmoe = Simulation(cfg, load_profile("configs/hardware/cpu_gloo_2proc.yaml"), 2, str(tmp_path)).planners[0][0]
    flexmoe.cost = COMPUTE_ONLY
    flexmoe.attach(SimpleNamespace(slot_table=SimpleNamespace(slots=np.array([[-1, 3, 0], [2, 1, -1]]))))
    slots, counts = flexmoe.propose(np.array([[2, 2, 6, 0], [6, 0, 9, 0]], dtype=float))
    assert slots.tolist() == [[2, 3, 0], [2, 1, 2]]
    assert counts == {"expand": 2}  # not {"expand": 3, "shrink": 1}


def _simulate(experts, ranks, trace, balancer, iterations, *overrides):
    """Balance ratio per iteration and bytes moved by vExpert moves, in all, of the first MoE layer."""
    cfg = load_config(None, ["model.num_layers=2", "model.hidden_size=1024", "model.ffn_hidden_size=4096",
                             "model.num_attention_heads=16", "model.seq_length=1024", f"moe.num_experts={experts}",
                             "moe.layer_freq=2", f"parallel.expert={ranks}", "training.micro_batch_size=16",
                             f"training.global_batch_size={16 * ranks}", f"moe.balancer={balancer}", *overrides])
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        sim = Simulation(cfg, load_profile(PROFILE), ranks, tmp)
        results = sim.run(sim.trace(trace, iterations, seed=0).steps(), limit=iterations)
    return (np.array([r.layers[0].balance_ratio for r in results]),
            sum(r.bytes_by_kind.get("vexpert_move", 0.0) for r in results))


def test_acceptance_64_experts_8_ranks_zipf_1_2():
    owners, _ = _simulate(64, 8, "zipf:1.2", "none", 20)
    flex, _ = _simulate(64, 8, "zipf:1.2", "flexmoe", 20)
    eplb, _ = _simulate(64, 8, "zipf:1.2", "eplb", 20)
    assert owners[-5:].mean() > 2.7  # the owners' layout
    assert flex[-5:].max() <= 1.10  # settled within a few iterations (Alg. 1 from the first step)
    assert eplb[-5:].max() <= 1.05


def test_acceptance_256_experts_64_ranks_zipf_1_0():
    flex, _ = _simulate(256, 64, "zipf:1.0", "flexmoe", 25)
    assert flex[-3:].max() <= 1.15
    eplb, _ = _simulate(256, 64, "zipf:1.0", "eplb", 20)  # eplb.hierarchical auto: global (no group routing)
    assert eplb[-3:].max() <= 1.05
    nodes, _ = _simulate(256, 64, "zipf:1.0", "eplb", 20, "moe.eplb.hierarchical=true")
    assert nodes[-3:].min() > 1.4  # one expert's 16% of the load > a node's 12.5%


def test_acceptance_drift_flexmoe_near_eplb_with_a_third_of_its_bytes():
    flex, flex_bytes = _simulate(64, 8, "drift:1.2:0.05", "flexmoe", 60)
    eplb, eplb_bytes = _simulate(64, 8, "drift:1.2:0.05", "eplb", 60)
    assert flex.mean() <= 1.1 * eplb.mean()
    assert 0 < flex_bytes <= eplb_bytes / 3


@pytest.mark.parametrize("override, needle", [("moe.flexmoe.trigger=sometimes", "moe.flexmoe.trigger"),
                                              ("moe.flexmoe.policy=best", "moe.flexmoe.policy"),
                                              ("moe.flexmoe.amortize_steps=0", "moe.flexmoe.amortize_steps")])
def test_flexmoe_config_errors(override, needle):
    cfg = load_config(None, ["moe.balancer=flexmoe", "moe.num_experts=4", override])
    with pytest.raises(ConfigError, match=needle):
        validate_config(cfg, 1)


def test_eplb_hierarchical_config():
    with pytest.raises(ConfigError, match="moe.eplb.hierarchical"):
        validate_config(load_config(None, ["moe.balancer=eplb", "moe.eplb.hierarchical=maybe"]), 1)
    for value in ("auto", "true", "false"):
        validate_config(load_config(None, ["moe.balancer=eplb", f"moe.eplb.hierarchical={value}"]), 1)
    # the hierarchical plan packs whole router groups onto nodes: 3 groups cannot split over 2 nodes
    # (4 EP ranks, 2 per node); known before start-up when parallel.ranks_per_node is set
    grouped = ["moe.balancer=eplb", "moe.num_experts=12", "moe.router_group_topk=1", "parallel.expert=4",
               "parallel.ranks_per_node=2", "training.global_batch_size=16"]
    with pytest.raises(ConfigError, match=r"^moe.router_groups=3 does not divide evenly over the 2 nodes of the ep "
                                          r"group \(2 EP ranks each\)"):
        validate_config(load_config(None, grouped + ["moe.router_groups=3"]), 4)
    for fine in (["moe.router_groups=3", "moe.eplb.hierarchical=false"], ["moe.router_groups=3", "parallel.ranks_per_node=4"],
                 ["moe.router_groups=2"], ["moe.router_groups=6"]):
        validate_config(load_config(None, grouped + fine), 4)
