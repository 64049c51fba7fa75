"""DeepSeek EPLB planning (techniques/eplb/eplb_plan.py): hand-worked examples, invariants and the max
rank load of `rebalance` against a brute-force optimum over all placements of small cases."""
import itertools
import statistics

import numpy as np
import pytest

from megatron_moe.techniques.eplb.eplb_plan import (balance_ratio, balanced_packing, max_rank_load, rank_loads,
                                                  rebalance, replicate_experts)


def test_replicate_experts_by_hand():
    # loads per replica [6, 3, 1]: slot 4 -> expert 0 ([3, 3, 1]); slot 5: experts 0 and 1 tie at 3,
    # the lower id wins -> counts [3, 1, 1]
    assert replicate_experts(np.array([6.0, 3.0, 1.0]), 5).tolist() == [3, 1, 1]
    # capped at 2 replicas: after [2, 1, 1] expert 0 is full, the next slot goes to expert 1
    assert replicate_experts(np.array([6.0, 3.0, 1.0]), 5, max_replicas=2).tolist() == [2, 2, 1]
    assert replicate_experts(np.array([0.0, 0.0]), 3).tolist() == [2, 1]  # all ties: lowest id


def test_balanced_packing_by_hand():
    # descending: w1=7 -> p0; w2=5 -> p1; w3=5 -> p1 (5 < 7); w0=3 -> p0 (7 < 10); w5=2 -> p0 (10 = 10,
    # lower pack); w4=1 -> p1, the only pack with room. Packs weigh 12 and 11.
    assert balanced_packing(np.array([3.0, 7, 5, 5, 1, 2]), 2, 3).tolist() == [0, 0, 1, 1, 1, 0]


def test_balanced_packing_labels_repair_dead_end():
    # 10 -> p0; the three 4s -> p1 (p1 full at 12); first L -> p0 (11). The second L finds only p0
    # with room, and p0 holds L: an item of p1 (the first 4, all tie) moves to p0 and L takes its place.
    weights = np.array([10.0, 4, 4, 4, 1, 1])
    labels = np.array([0, 1, 2, 3, 4, 4])
    pack = balanced_packing(weights, 2, 3, labels=labels)
    assert pack.tolist() == [0, 0, 1, 1, 0, 1]
    assert [weights[pack == p].sum() for p in (0, 1)] == [15.0, 9.0]


def test_rebalance_flat_by_hand():
    # 6 slots, at most 2 replicas each: expert 0 (8) -> 2 replicas; expert 0 is then capped, 4 vs 4
    # tie -> expert 1. Replicas 4, 4, 2, 2, 2, 2 alternate ranks -> both ranks 4 + 2 + 2 = 8.
    slot_to_expert, count = rebalance(np.array([8.0, 4, 2, 2]), num_ranks=2, slots_per_rank=3)
    assert slot_to_expert.tolist() == [[0, 1, 2], [0, 1, 3]]
    assert count.tolist() == [2, 2, 1, 1]
    assert max_rank_load(np.array([8.0, 4, 2, 2]), slot_to_expert, count) == 8.0
    assert balance_ratio(np.array([8.0, 4, 2, 2]), slot_to_expert, count) == 1.0


def test_rebalance_known_gap_to_optimum():
    # [10, 10, 1] on 2 ranks x 2 slots: the extra slot goes to expert 0 (tie, lower id) -> replicas
    # 5, 5, 10, 1; 10 -> r0, 5 -> r1, the second 5 may not join r1 -> r0 = 15. The optimum replicates
    # the light expert: [[0, 2], [1, 2]] = 10.5 each. 15 / 10.5 = 1.43, the worst case we know of.
    load = np.array([10.0, 10, 1])
    slot_to_expert, count = rebalance(load, 2, 2)
    assert slot_to_expert.tolist() == [[0, 1], [0, 2]]
    assert rank_loads(load, slot_to_expert, count).tolist() == [15.0, 6.0]
    assert rank_loads(load, np.array([[0, 2], [1, 2]]), np.array([1, 1, 2])).tolist() == [10.5, 10.5]


def test_rebalance_hierarchical_by_hand():
    # experts -> 2 nodes (3 each): 10 -> n0; 6 -> n1; 4 -> n1 (6 < 10); 3 -> n0 (tie); 2 -> n1; 1 -> n0.
    # node 0 = {0, 1, 5} loads [10, 1, 3]: extra slot -> expert 0; replicas 5, 5, 3, 1 -> ranks
    # {0, 5} = 8 and {0, 1} = 6. node 1 = {2, 3, 4} loads [4, 6, 2]: extra -> expert 3; replicas
    # 4 -> r2, 3 -> r3, 3 -> r2 (r3 holds expert 3), 2 -> r3: {2, 3} = 7 and {3, 4} = 5.
    load = np.array([10.0, 1, 4, 6, 2, 3])
    slot_to_expert, count = rebalance(load, num_ranks=4, slots_per_rank=2, ranks_per_node=2)
    assert slot_to_expert.tolist() == [[0, 5], [0, 1], [2, 3], [3, 4]]
    assert count.tolist() == [2, 1, 1, 2, 1, 1]
    assert rank_loads(load, slot_to_expert, count).tolist() == [8.0, 6.0, 7.0, 5.0]


def _check_invariants(load, slot_to_expert, count, num_ranks, slots_per_rank):
    assert slot_to_expert.shape == (num_ranks, slots_per_rank)
    assert count.min() >= 1 and count.sum() == num_ranks * slots_per_rank
    assert np.array_equal(np.bincount(slot_to_expert.ravel(), minlength=load.size), count)
    for row in slot_to_expert:
        assert len(set(row.tolist())) == slots_per_rank  # no expert twice on a rank


@pytest.mark.parametrize("seed", range(3))
def test_rebalance_invariants_random(seed):
    rng = np.random.default_rng(seed)
    for _ in range(60):
        num_experts, num_ranks = int(rng.integers(2, 10)), int(rng.integers(1, 5))
        slots_per_rank = int(rng.integers(-(-num_experts // num_ranks), num_experts + 1))
        load = rng.zipf(1.5, size=num_experts).astype(float)
        slot_to_expert, count = rebalance(load, num_ranks, slots_per_rank)
        _check_invariants(load, slot_to_expert, count, num_ranks, slots_per_rank)
        assert rank_loads(load, slot_to_expert, count).sum() == pytest.approx(load.sum())


def test_rebalance_through_packing_repair():
    # a case found by random search where packing hits the dead end `_make_room` repairs
    load = np.array([1.0, 1, 2, 2, 7, 1, 1, 1])
    slot_to_expert, count = rebalance(load, 3, 6)
    _check_invariants(load, slot_to_expert, count, 3, 6)


@pytest.mark.parametrize("seed", range(3))
def test_hierarchical_keeps_replicas_in_their_node(seed):
    rng = np.random.default_rng(seed)
    for _ in range(30):
        nodes, ranks_per_node = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        per_node = int(rng.integers(1, 5))
        slots_per_rank = int(rng.integers(-(-per_node // ranks_per_node), per_node + 1))
        load = rng.integers(0, 50, size=nodes * per_node).astype(float)
        slot_to_expert, count = rebalance(load, nodes * ranks_per_node, slots_per_rank, ranks_per_node)
        _check_invariants(load, slot_to_expert, count, nodes * ranks_per_node, slots_per_rank)
        node_experts = slot_to_expert.reshape(nodes, -1)
        for node in range(nodes):
            assert np.unique(node_experts[node]).size == per_node  # the node's own E / nodes experts
        assert np.unique(node_experts).size == load.size  # ... and no expert in two nodes


def _brute_force(load, num_ranks, slots_per_rank):
    """Lowest max rank load over every placement with >= 1 replica per expert and no expert twice on a rank."""
    best = np.inf
    for ranks in itertools.product(itertools.combinations(range(load.size), slots_per_rank), repeat=num_ranks):
        slot_to_expert = np.array(ranks)
        count = np.bincount(slot_to_expert.ravel(), minlength=load.size)
        if count.min() >= 1:
            best = min(best, max_rank_load(load, slot_to_expert, count))
    return best


def test_rebalance_near_brute_force_optimum():
    """Max rank load of `rebalance` / the brute-force optimum on every shape with E <= 4, ranks <= 2,
    slots_per_rank <= 3 (8 shapes), 40 uniform loads in 1..100 each plus their squares (640 cases).
    Measured: optimal in 562 of 640, mean 1.0127, worst 1.3469 (the worst case we know of, 10/7,
    is test_rebalance_known_gap_to_optimum); pinned slightly above."""
    rng = np.random.default_rng(0)
    shapes = [(e, r, s) for r in (1, 2) for s in (1, 2, 3) for e in range(max(s, 2), 5) if e <= r * s]
    ratios = []
    for num_experts, num_ranks, slots_per_rank in shapes:
        for _ in range(40):
            uniform = rng.integers(1, 101, size=num_experts).astype(float)
            for load in (uniform, uniform ** 2):
                slot_to_expert, count = rebalance(load, num_ranks, slots_per_rank)
                optimum = _brute_force(load, num_ranks, slots_per_rank)
                ratios.append(max_rank_load(load, slot_to_expert, count) / optimum)
    assert len(ratios) == 640 and min(ratios) >= 1 - 1e-12
    assert statistics.mean(ratios) <= 1.02
    assert max(ratios) <= 1.35


@pytest.mark.parametrize("args, message", [
    ((np.array([1.0, 2, 3]), 1, 2), "slots < E"),
    ((np.array([1.0, 2]), 2, 3), "two replicas of one expert"),
    ((np.array([1.0, 2, 3]), 2, 2, 1), "not divisible by 2 nodes"),
    ((np.array([1.0, 2, 3, 4]), 3, 2, 2), "multiple of ranks_per_node"),
    ((np.array([1.0, 2, 3, 4]), 2, 3, 1), "per node"),
    ((np.array([1.0, -2]), 2, 1), "non-negative"),
    ((np.array([]), 2, 1), "non-empty"),
])
def test_rebalance_rejects_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        rebalance(*args)


def test_helpers_reject_bad_input():
    with pytest.raises(ValueError, match="cannot give each"):
        replicate_experts(np.array([1.0, 2, 3]), 2)
    with pytest.raises(ValueError, match="exceed"):
        replicate_experts(np.array([1.0, 2]), 5, max_replicas=2)
    with pytest.raises(ValueError, match="do not fill"):
        balanced_packing(np.array([1.0, 2, 3]), 2, 2)
    with pytest.raises(ValueError, match="more than 2 items"):
        balanced_packing(np.array([1.0, 2, 3, 4]), 2, 2, labels=np.array([0, 0, 0, 1]))
    with pytest.raises(ValueError, match="does not match"):
        rank_loads(np.array([1.0, 2]), np.array([[0, 1]]), np.array([2, 1]))
