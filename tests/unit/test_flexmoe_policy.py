"""FlexMoE's straggler-relative policy maker (techniques/flexmoe/flexmoe_policy.py) and the issue-30
acceptance: FlexMoE and EPLB driven the way training drives them (the simulator calls the
balancers' own `plan` / `observe` / `decide`) on skewed and drifting Zipf routing, on the FlexMoE
testbed profile. Balance ratio = max rank rows / mean rank rows of a layer's forward."""
import numpy as np
import pytest

from megatron_moe.config import ConfigError, load_config
from megatron_moe.config.validate import validate_config
from megatron_moe.techniques.flexmoe.flexmoe_plan import (Expand, FlexCostModel, Migrate, StepCosts, _delta, apply_ops,
                                                     make_scheduling_plan, schedule, vexpert_counts)
from megatron_moe.techniques.flexmoe.flexmoe_policy import straggler_plan
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
