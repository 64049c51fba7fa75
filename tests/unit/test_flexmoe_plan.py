"""FlexMoE planning (techniques/flexmoe/flexmoe_plan.py): Eq. 6, Alg. 3 routing, the Eq. 5-9 cost
model, the Alg. 2 policy maker and Alg. 1 scheduler on worked examples, and placement invariants."""
import numpy as np
import pytest

from megatron_moe.techniques.flexmoe.flexmoe import primitive_counts
from megatron_moe.techniques.flexmoe.flexmoe_plan import (Expand, FlexCostModel, Migrate, Shrink, apply_ops,
                                                          balance_ratio, flexible_routing, make_scheduling_plan,
                                                          net_primitives, propose_migration, rank_tokens, schedule,
                                                          vexpert_counts)
from tests.dense_reference import dense_flexible_routing, dense_rank_times, scatter_pairs

# Fig. 1b: GPU 1 routes 6 tokens to expert 1 and 3 to expert N, GPU N routes 4 and 5 (experts 0, 1
# here). Each GPU has 9 vExpert slots, all of its own expert: the ideal B / (G x V) = 18 / 18 = 1 token.
FIG1B_COUNTS = np.array([[6, 3], [4, 5]])
FIG1B_SLOTS = np.array([[0] * 9, [1] * 9])
COMPUTE_ONLY = FlexCostModel(seconds_per_token=1.0)


def test_balance_ratio_eq6_by_hand():
    # Fig. 1b as drawn (one expert per GPU): 10 and 8 tokens, mean 9
    assert balance_ratio(np.array([10, 8]), np.array([[0], [1]])) == pytest.approx(10 / 9)
    # expert 0 split over two GPUs: [3 + 2, 3 + 4] = [5, 7], mean 6
    assert balance_ratio(np.array([6, 2, 4]), np.array([[0, 1], [0, 2]])) == pytest.approx(7 / 6)
    # three vExperts of expert 0 (two on GPU 0, one free slot there): [2 + 2, 2 + 2 + 4] = [4, 8]
    slots = np.array([[0, 0, -1], [0, 1, 2]])
    assert rank_tokens(np.array([6, 2, 4]), slots).tolist() == [4.0, 8.0]
    assert balance_ratio(np.array([6, 2, 4]), slots) == pytest.approx(8 / 6)
    assert balance_ratio(np.array([0, 0]), np.array([[0], [1]])) == 1.0


def test_flexible_routing_alg3_by_hand():
    # after Alg. 2 on Fig. 1b: GPU 0 has 9 vExperts of expert 0, GPU 1 one of expert 0 and 8 of expert 1;
    # cap_0 = 10 / 10 = 1, cap_1 = 8 / 8 = 1. Expert 0: GPU 0 keeps its 6 (capacity 9); GPU 1 keeps 1
    # (capacity 1) and sends 3 to GPU 0, whose free capacity is 9 - 6 = 3. Expert 1: only GPU 1 holds
    # it, GPU 0 sends its 3 there, GPU 1 keeps 5.
    slots = np.array([[0] * 9, [0] + [1] * 8])
    routing = flexible_routing(FIG1B_COUNTS, [0, 1], slots)
    # the (expert, GPU) pairs: expert 0 on both GPUs, expert 1 on GPU 1
    assert routing.experts.tolist() == [0, 0, 1] and routing.ranks.tolist() == [0, 1, 1]
    assert routing.values.tolist() == [[6, 0, 3], [3, 1, 5]]
    table = scatter_pairs(routing, 2)  # [S, E, G]
    assert table.tolist() == [[[6, 0], [0, 3]], [[3, 1], [0, 5]]]
    # two sources on GPU 0 share its routing in proportion to their counts
    split = scatter_pairs(flexible_routing(np.array([[4, 1], [2, 2], [4, 5]]), [0, 0, 1], slots), 2)
    assert split[0].tolist() == [[4, 0], [0, 1]] and split[1].tolist() == [[2, 0], [0, 2]]
    assert split[2].tolist() == table[1].tolist()


def test_flexible_routing_fills_every_vexpert_to_cap():
    rng = np.random.default_rng(0)
    for _ in range(30):
        slots = _random_slots(rng, 3, 3, 4)
        counts = rng.integers(0, 20, size=(5, 4))
        sources = rng.integers(0, 3, size=5)
        table = scatter_pairs(flexible_routing(counts, sources, slots), 3)
        n = vexpert_counts(slots, 4)
        np.testing.assert_allclose(table.sum(2), counts)  # every token goes somewhere
        np.testing.assert_allclose(table.sum(0).T, n * (counts.sum(0) / n.sum(0)))  # cap_e per vExpert
        np.testing.assert_allclose(table.sum(0).sum(0), rank_tokens(counts.sum(0), slots))  # = Eq. 6's split


@pytest.mark.parametrize("seed", range(2))
def test_pair_routing_and_cost_model_equal_the_dense_alg3(seed):
    # the pairs hold exactly the dense table's floats (the same operations per entry, zeros
    # elsewhere); Eq. 5 from the capacities equals Eq. 5 from the dense table up to rounding
    rng = np.random.default_rng(seed)
    model = FlexCostModel(seconds_per_token=1.0, seconds_per_token_sent=0.3, seconds_per_param_sent=0.01,
                          params_per_expert=50)
    for _ in range(100):
        num_ranks, per_rank = int(rng.integers(1, 9)), int(rng.integers(1, 5))
        num_experts = int(rng.integers(1, num_ranks * per_rank + 1))
        slots = _random_slots(rng, num_ranks, per_rank, num_experts)
        num_sources = int(rng.integers(1, 12))
        counts = rng.integers(0, 40, size=(num_sources, num_experts)) * (rng.random((num_sources, num_experts)) < 0.7)
        sources = rng.integers(0, num_ranks, size=num_sources)
        routing = flexible_routing(counts, sources, slots)
        held = vexpert_counts(slots, num_experts) > 0
        assert list(zip(routing.experts.tolist(), routing.ranks.tolist())) == list(zip(*np.nonzero(held.T)))
        dense = dense_flexible_routing(counts, sources, slots)
        assert np.array_equal(scatter_pairs(routing, num_ranks), dense)
        own = rng.integers(0, 40, size=(num_ranks, num_experts))
        np.testing.assert_allclose(model.rank_times(own, slots), dense_rank_times(model, own, slots),
                                   rtol=1e-12, atol=1e-12)


def test_alg2_expands_only_e0_and_returns_nothing_when_e0_cannot_help():
    # Alg. 2 as printed: e0 = argmax cap_e (line 6), return {} unless the plan lowers Eq. 5 (lines
    # 8-10). Expert 0 (20 tokens) already has a second vExpert on GPU 3, next to expert 3 (9).
    # cap = [10, 11, 1, 9]: e0 = expert 1, on GPU 1 (11 tokens); the slowest GPU is 3 (9 + 10 = 19)
    slots = np.array([[0, -1], [1, -1], [2, -1], [3, 0]])
    counts = np.array([[5, 3, 1, 2], [5, 3, 0, 2], [5, 3, 0, 2], [5, 2, 0, 3]])
    assert COMPUTE_ONLY.rank_times(counts, slots).tolist() == [10, 11, 1, 19]
    # no Expand of expert 1 (nor Shrink of expert 0, the only e1, then Expand of 1) lowers GPU 3's 19
    assert make_scheduling_plan(counts, slots, COMPUTE_ONLY) == []
    assert schedule(counts, slots, COMPUTE_ONLY, threshold=1.1) == []  # Alg. 1 lines 5-6: break
    # although a third vExpert of expert 0 (not e0) would: 20 / 3 tokens each, GPU 3 at 15.67
    better = apply_ops(slots, [Expand(0, 0, 2, 1)])
    assert COMPUTE_ONLY.step_time(counts, better) == pytest.approx(9 + 20 / 3)


def test_cost_model_eq5_by_hand():
    model = FlexCostModel(seconds_per_token=1.0, seconds_per_token_sent=0.1)
    # GPU 0 computes 10 tokens, 4 from GPU 1: 10 + 4 x 4 x 0.1; GPU 1 computes 8, 3 remote: 8 + 1.2
    np.testing.assert_allclose(model.rank_times(FIG1B_COUNTS, FIG1B_SLOTS), [11.6, 9.2])
    # after the plan both compute 9 and receive 3 (table above): 9 + 1.2
    np.testing.assert_allclose(model.rank_times(FIG1B_COUNTS, np.array([[0] * 9, [0] + [1] * 8])), [10.2, 10.2])
    # Eq. 9: both experts on both GPUs, ring all-reduce of 100 params: 2 (2 - 1) / 2 x 100 x 0.01 = 1
    # per expert; 4 tokens computed locally each
    sync = FlexCostModel(seconds_per_token=1.0, seconds_per_param_sent=0.01, params_per_expert=100,
                         state_params_per_expert=300)
    np.testing.assert_allclose(sync.rank_times(np.array([[2, 2], [2, 2]]), np.array([[0, 1], [0, 1]])), [6, 6])
    # transfer: only ops that cross GPUs move 300 state params at 0.01 s each
    ops = [Shrink(1, 0, 1), Expand(0, 0, 0, 1), Expand(0, 0, 1, 0), Migrate(0, 0, 0, 1, 1), Migrate(0, 1, 0, 1, 1)]
    assert sync.adjust_time(ops) == pytest.approx(2 * 3.0)


def test_alg2_fig1b_expands_hot_expert_and_shrinks_cold_one():
    # cap_0 = 10 / 9 > cap_1 = 8 / 9: shrink expert 1's first slot on GPU 1, expand expert 0 there
    # (copied from GPU 0): GPU 0 = 9 vExperts x 1 token, GPU 1 = 1 + 8 x 1 -> balanced, t 10 -> 9
    plan = make_scheduling_plan(FIG1B_COUNTS, FIG1B_SLOTS, COMPUTE_ONLY)
    assert plan == [Shrink(1, 1, 0), Expand(0, 0, 1, 0)]
    after = apply_ops(FIG1B_SLOTS, plan)
    assert balance_ratio(FIG1B_COUNTS.sum(0), after) == 1.0
    assert COMPUTE_ONLY.step_time(FIG1B_COUNTS, after) == 9.0
    assert schedule(FIG1B_COUNTS, FIG1B_SLOTS, COMPUTE_ONLY, threshold=1.05) == plan


def test_alg1_fig1b_with_all_to_all_then_migrates_toward_the_sources():
    # with all-to-all cost, after the Expand/Shrink (11.6 -> 10.2) Migrates pay too: each swaps a
    # vExpert of expert 0 on GPU 0 with one of expert 1 on GPU 1, until each GPU's vExperts mirror its
    # own gate (6 + 3 and 4 + 5): no token crosses GPUs and both take 9
    model = FlexCostModel(seconds_per_token=1.0, seconds_per_token_sent=0.1)
    ops = schedule(FIG1B_COUNTS, FIG1B_SLOTS, model, threshold=1.05)
    assert ops == [Shrink(1, 1, 0), Expand(0, 0, 1, 0)] + [Migrate(0, 0, s, 1, s + 1) for s in range(3)]
    after = apply_ops(FIG1B_SLOTS, ops)
    assert after.tolist() == [[1, 1, 1] + [0] * 6, [0] * 4 + [1] * 5]
    np.testing.assert_allclose(model.rank_times(FIG1B_COUNTS, after), [9.0, 9.0])


def test_alg2_no_op_when_moving_does_not_pay():
    # the Expand moves 1000 state params at 0.01 s: 9 + 10 > 10 -> nothing; spread over 100 steps
    # 9 + 0.1 < 10 -> the Fig. 1b plan again
    costly = FlexCostModel(seconds_per_token=1.0, seconds_per_param_sent=0.01, state_params_per_expert=1000)
    assert make_scheduling_plan(FIG1B_COUNTS, FIG1B_SLOTS, costly) == []
    assert schedule(FIG1B_COUNTS, FIG1B_SLOTS, costly, threshold=1.05) == []
    amortized = FlexCostModel(seconds_per_token=1.0, seconds_per_param_sent=0.01, state_params_per_expert=1000,
                              amortize_steps=100)
    assert make_scheduling_plan(FIG1B_COUNTS, FIG1B_SLOTS, amortized) == [Shrink(1, 1, 0), Expand(0, 0, 1, 0)]
    # Eq. 9: expert 0 on two GPUs syncs 1000 params, 2 (2 - 1) / 2 x 1000 x 0.01 = 10 s > the 1 s gained
    syncing = FlexCostModel(seconds_per_token=1.0, seconds_per_param_sent=0.01, params_per_expert=1000)
    assert make_scheduling_plan(FIG1B_COUNTS, FIG1B_SLOTS, syncing) == []


def test_no_op_when_balanced():
    counts = np.array([[3, 3], [3, 3]])
    slots = np.array([[0, 0], [1, 1]])
    # Alg. 2's only candidate (shrink expert 1 on GPU 1, expand expert 0 there) gives [2 + 2, 2 + 6]
    # tokens, worse than [6, 6]; no expert is replicated, so no Migrate either
    assert balance_ratio(counts.sum(0), slots) == 1.0
    assert schedule(counts, slots, COMPUTE_ONLY, threshold=1.1) == []
    assert schedule(np.array([[5, 0], [0, 5]]), np.array([[0], [1]]), COMPUTE_ONLY, threshold=1.0) == []


def test_alg2_prefers_expand_into_a_free_slot():
    # tokens [8, 2] on [[0, 1], [1, free]]: GPU loads [8 + 1, 1]. Shrink expert 1 + expand expert 0
    # reaches 6 at best ([[0, -], [1, 0]]: [4, 2 + 4]; [[0, 1], [0, -]]: [4 + 2, 4]); expanding
    # expert 0 into the free slot alone gives [4 + 1, 1 + 4]
    plan = make_scheduling_plan(np.array([[8, 2], [0, 0]]), np.array([[0, 1], [1, -1]]), COMPUTE_ONLY)
    assert plan == [Expand(0, 0, 1, 1)]
    # no expert can be shrunk (all have one vExpert): the Expand alone into the free slot
    assert make_scheduling_plan(np.array([[8, 2, 2], [0, 0, 0]]), np.array([[0, 1], [2, -1]]),
                                COMPUTE_ONLY) == [Expand(0, 0, 1, 1)]


def test_migrate_consolidates_replicas_when_sync_costs():
    # both experts on both GPUs: each GPU computes 4 tokens and syncs 2 experts x 1 s = 6. Exchanging
    # expert 0 on GPU 0 with expert 1 on GPU 1 leaves each expert on one GPU: 4 + 300 x 0.01 transfer = 7
    # > 6 at one step; with the transfer spread over 3 steps 4 + 1 = 5 < 6
    counts, slots = np.array([[2, 2], [2, 2]]), np.array([[0, 1], [0, 1]])
    costly = FlexCostModel(seconds_per_token=1.0, seconds_per_param_sent=0.01, params_per_expert=100,
                           state_params_per_expert=300)
    assert propose_migration(counts, slots, costly) is None
    assert schedule(counts, slots, costly, threshold=1.1) == []
    cheap = FlexCostModel(seconds_per_token=1.0, seconds_per_param_sent=0.01, params_per_expert=100,
                          state_params_per_expert=300, amortize_steps=3)
    assert schedule(counts, slots, cheap, threshold=1.1) == [Migrate(0, 0, 0, 1, 1)]
    assert apply_ops(slots, [Migrate(0, 0, 0, 1, 1)]).tolist() == [[1, 1], [0, 0]]


def test_an_expand_a_later_shrink_undoes_counts_as_neither():
    # Alg. 2 as printed, tokens [8, 2, 15] (expert 1 and 2 on GPU 1, expert 0 on GPU 0): plan 1
    # expands e0 = 2 onto GPU 0 ([15.5, 9.5]); plan 2 expands e0 = 0 into GPU 1's free slot
    # ([11.5, 13.5]); plan 3 (cap [4, 2, 7.5]) shrinks e1 = 0 there and expands 2 into the slot
    # ([13, 12]). Expert 0 on GPU 1 came and went within one decision: no primitive, no transfer
    slots, counts = np.array([[-1, -1, 0], [2, 1, -1]]), np.array([[2, 2, 6], [6, 0, 9]])
    ops = schedule(counts, slots, COMPUTE_ONLY, threshold=1.0)
    assert ops == [Expand(2, 1, 0, 0), Expand(0, 0, 1, 2), Shrink(0, 1, 2), Expand(2, 1, 1, 2)]
    assert net_primitives(ops) == [Expand(2, 1, 0, 0), Expand(2, 1, 1, 2)]
    assert primitive_counts(ops) == {"expand": 2}  # what FlexMoE reports (vexpert_moves, vexpert_ops_total)
    # one transfer (expert 2 to GPU 0; GPU 1's second vExpert of 2 shares its weights), not two
    moving = FlexCostModel(seconds_per_token=1.0, seconds_per_param_sent=1.0, state_params_per_expert=1)
    assert moving.adjust_time(ops) == 1.0
    # either order cancels; another GPU or expert does not; two Expands and one Shrink leave one
    assert net_primitives([Shrink(0, 1, 0), Expand(0, 0, 1, 0)]) == []
    assert net_primitives([Expand(0, 0, 1, 2), Shrink(0, 0, 1)]) == [Expand(0, 0, 1, 2), Shrink(0, 0, 1)]
    assert net_primitives([Expand(0, 0, 1, 2), Shrink(1, 1, 2)]) == [Expand(0, 0, 1, 2), Shrink(1, 1, 2)]
    assert net_primitives([Expand(0, 0, 1, 1), Expand(0, 0, 1, 2), Shrink(0, 1, 1)]) == [Expand(0, 0, 1, 2)]
    assert primitive_counts([Migrate(0, 0, 0, 1, 1), Shrink(0, 1, 0), Expand(0, 0, 1, 0)]) == {"migrate": 1}


def _random_slots(rng, num_ranks, slots_per_rank, num_experts):
    """A placement with every expert at least once and some free slots."""
    cells = rng.permutation(num_ranks * slots_per_rank)
    flat = np.full(num_ranks * slots_per_rank, -1)
    flat[cells[:num_experts]] = np.arange(num_experts)
    extra = cells[num_experts:]
    flat[extra] = np.where(rng.random(extra.size) < 0.7, rng.integers(0, num_experts, extra.size), -1)
    return flat.reshape(num_ranks, slots_per_rank)


@pytest.mark.parametrize("seed", range(3))
def test_schedule_invariants_random(seed):
    rng = np.random.default_rng(seed)
    for _ in range(15):
        num_ranks, slots_per_rank = int(rng.integers(2, 4)), int(rng.integers(1, 4))
        num_experts = int(rng.integers(1, num_ranks * slots_per_rank + 1))
        slots = _random_slots(rng, num_ranks, slots_per_rank, num_experts)
        counts = rng.zipf(1.6, size=(num_ranks, num_experts)).astype(float)
        model = FlexCostModel(seconds_per_token=1e-3, seconds_per_token_sent=float(rng.choice([0, 2e-4])),
                              seconds_per_param_sent=1e-4, params_per_expert=int(rng.choice([0, 20])),
                              state_params_per_expert=30)
        ops = schedule(counts, slots, model, threshold=1.05)
        after = apply_ops(slots, ops)  # raises on an op the placement does not allow
        assert after.shape == slots.shape
        assert vexpert_counts(after, num_experts).sum(0).min() >= 1  # every expert keeps a vExpert
        assert np.count_nonzero(after >= 0) == np.count_nonzero(slots >= 0) + sum(
            isinstance(op, Expand) for op in ops) - sum(isinstance(op, Shrink) for op in ops)
        before_time, after_time = model.step_time(counts, slots), model.step_time(counts, after)
        assert after_time < before_time if ops else after_time == before_time


def test_apply_ops_rejects_invalid_ops():
    slots = np.array([[0, 1], [1, -1]])
    for op, message in [(Expand(0, 0, 0, 1), "destination slot holds"), (Expand(0, 1, 1, 1), "source rank holds no"),
                        (Shrink(0, 0, 0), "last vExpert"), (Shrink(1, 0, 0), "slot holds expert 0"),
                        (Migrate(1, 0, 0, 1, 1), "source slot holds"), (Expand(0, 0, 2, 0), "outside"),
                        (Shrink(1, 0, -1), "outside")]:
        with pytest.raises(ValueError, match=message):
            apply_ops(slots, [op])
    assert apply_ops(slots, [Shrink(1, 0, 1), Expand(0, 0, 0, 1)]).tolist() == [[0, 0], [1, -1]]
    assert slots.tolist() == [[0, 1], [1, -1]]  # the input is not modified


def test_placement_validation():
    with pytest.raises(ValueError, match=r"experts \[2\] have no vExpert"):
        balance_ratio(np.array([1, 1, 1]), np.array([[0], [1]]))
    with pytest.raises(ValueError, match="expert ids"):
        balance_ratio(np.array([1, 1]), np.array([[0], [3]]))
    with pytest.raises(ValueError, match="one row per GPU"):
        COMPUTE_ONLY.step_time(np.array([[1, 1]]), np.array([[0], [1]]))
    with pytest.raises(ValueError, match="source ranks"):
        flexible_routing(np.array([[1, 1]]), [2], np.array([[0], [1]]))
