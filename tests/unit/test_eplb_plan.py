"""DeepSeek EPLB planning (techniques/eplb/eplb_plan.py): hand-worked examples, invariants and the max
rank load of `rebalance` against a brute-force optimum over all placements of small cases."""
import collections
import itertools
import statistics

import numpy as np
import pytest
import torch

from megatron_moe.config import load_config
from megatron_moe.config.validate import validate_config
from megatron_moe.techniques.eplb.eplb import planned_ranks_per_node
from megatron_moe.techniques.eplb.eplb_plan import (balance_ratio, balanced_packing, max_rank_load, rank_loads,
                                                  rebalance, replicate_experts)


def test_replicate_experts_by_hand():
    # loads per replica [6, 3, 1]: slot 4 -> expert 0 ([3, 3, 1]); slot 5: experts 0 and 1 tie at 3,
    # the lower id wins -> counts [3, 1, 1]
    assert replicate_experts(np.array([6.0, 3.0, 1.0]), 5).tolist() == [3, 1, 1]
    # capped at 2 replicas: after [2, 1, 1] expert 0 is full, the next slot goes to expert 1
    assert replicate_experts(np.array([6.0, 3.0, 1.0]), 5, max_replicas=2).tolist() == [2, 2, 1]
    assert replicate_experts(np.array([0.0, 0.0]), 3).tolist() == [2, 1]  # all ties: lowest id


def test_replicate_by_load_per_replica_not_total_load():
    """DeepSeek EPLB's replicate step gives each redundant slot to the expert with the highest load /
    replica count; by total load the hottest expert would take every slot up to its cap."""
    # [6, 5, 4], 3 extra slots. Per replica: 6 -> e0 (now 3 per replica); 5 > 4 > 3 -> e1 (2.5);
    # 4 > 3 > 2.5 -> e2 -> counts [2, 2, 2]. By total load: e0, e0, e0 -> [4, 1, 1] (unbounded) and
    # [3, 2, 1] at 3 replicas at most (e0, e0, then e1).
    load = np.array([6.0, 5, 4])
    assert replicate_experts(load, 6).tolist() == [2, 2, 2]
    assert replicate_experts(load, 6, max_replicas=3).tolist() == [2, 2, 2]
    # the flat plan on 3 ranks x 2 slots (at most 3 replicas): replicas 3, 3, 2.5, 2.5, 2, 2 -> e0 3 to
    # r0, e0 3 to r1, e1 2.5 to r2 (empty), e1 2.5 to r0 (r0 = r1 = 3, lower pack), e2 2 to r2 (2.5 <
    # 3), e2 2 to r1: ranks 5.5, 5, 4.5. By total load, [3, 2, 1]: replicas 4, 2.5, 2.5, 2, 2, 2 -> 6.
    slot_to_expert, count = rebalance(load, num_ranks=3, slots_per_rank=2)
    assert count.tolist() == [2, 2, 2] and slot_to_expert.tolist() == [[0, 1], [0, 2], [1, 2]]
    assert rank_loads(load, slot_to_expert, count).tolist() == [5.5, 5.0, 4.5]


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


def test_hierarchical_packs_router_groups_by_hand():
    # 4 groups of 2 experts: loads g0 = 6, g1 = 4, g2 = 1, g3 = 9 -> 2 nodes (2 groups each): 9 -> n0;
    # 6 -> n1; 4 -> n1 (6 < 9); 1 -> n0. Node 0 = experts {4, 5, 6, 7} loads [0, 1, 6, 3]: the 2
    # extra slots -> expert 6, then 7 (6 is capped at 2 ranks); replicas 3, 3, 1.5, 1.5, 1, 0 ->
    # ranks {5, 6, 7} = 5.5 and {4, 6, 7} = 4.5. Node 1 = experts {0, 1, 2, 3} loads [5, 1, 2, 2]:
    # extra -> 0, then 2 (tie with 3, lower id); replicas 2.5 -> r2, 2.5 -> r3, 2 (expert 3) -> r2,
    # 1 (expert 1) -> r3, 1 (expert 2) -> r3, 1 (expert 2) -> r2: {0, 2, 3} = 5.5, {0, 1, 2} = 4.5.
    load = np.array([5.0, 1, 2, 2, 0, 1, 6, 3])
    slot_to_expert, count = rebalance(load, num_ranks=4, slots_per_rank=3, ranks_per_node=2, groups=4)
    assert slot_to_expert.tolist() == [[5, 6, 7], [4, 6, 7], [0, 2, 3], [0, 1, 2]]
    assert count.tolist() == [2, 1, 2, 1, 1, 1, 2, 2]
    assert rank_loads(load, slot_to_expert, count).tolist() == [5.5, 4.5, 5.5, 4.5]
    # single experts (no router groups) packed by load: 6 -> n0, 5 -> n1, 3 -> n1, 2 -> n0, 2 -> n0
    # (tie), 1 -> n1, 1 -> n1, 0 -> n0: nodes {2, 3, 4, 6} and {0, 1, 5, 7} split groups 2 and 3
    single, _ = rebalance(load, 4, 3, 2)
    assert [sorted(set(single[:2].ravel().tolist())), sorted(set(single[2:].ravel().tolist()))] == \
        [[2, 3, 4, 6], [0, 1, 5, 7]]


@pytest.mark.parametrize("seed", range(3))
def test_hierarchical_keeps_router_groups_in_one_node(seed):
    rng = np.random.default_rng(seed)
    for _ in range(30):
        nodes, ranks_per_node = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        groups, group_size = nodes * int(rng.integers(1, 4)), int(rng.integers(1, 4))
        num_experts = groups * group_size
        per_node = num_experts // nodes
        slots_per_rank = int(rng.integers(-(-per_node // ranks_per_node), per_node + 1))
        load = rng.zipf(1.5, size=num_experts).astype(float)
        slot_to_expert, count = rebalance(load, nodes * ranks_per_node, slots_per_rank, ranks_per_node, groups)
        _check_invariants(load, slot_to_expert, count, nodes * ranks_per_node, slots_per_rank)
        node_of = {}
        for rank, row in enumerate(slot_to_expert.tolist()):
            for expert in row:
                assert node_of.setdefault(expert, rank // ranks_per_node) == rank // ranks_per_node
        for g in range(groups):  # every expert of a group, and every replica, on the group's node
            assert len({node_of[e] for e in range(g * group_size, (g + 1) * group_size)}) == 1
        assert sorted(collections.Counter(node_of.values()).values()) == [per_node] * nodes


def _nodes_per_token(slot_to_expert, ranks_per_node, expert_ids):
    """Int[n]: nodes holding each token's experts (every replica of an expert sits in one node)."""
    node = np.empty(slot_to_expert.max() + 1, dtype=np.int64)
    node[slot_to_expert] = np.arange(slot_to_expert.shape[0])[:, None] // ranks_per_node
    return np.array([len(set(row)) for row in node[expert_ids].tolist()])


def test_router_groups_on_nodes_against_single_expert_packing():
    """DeepSeek-style routing (sigmoid scores, 8 groups of 8 experts, a token's top-8 within its 2
    best groups, moe/router.py's `top_k_gating`) of 4096 tokens with Zipf(1.0)-skewed logits; the
    loads they give planned on 4 nodes x 4 ranks (+16 slots) by the hierarchical plan with the
    router's groups and with single experts (the packing before). With groups no token's experts
    span more than router_group_topk = 2 nodes, as node-limited routing intends; single-expert
    packing splits groups, and tokens reach more nodes. The cost is balance: whole groups are
    coarser items to pack. Measured: nodes per token 1.94 (max 2) with groups against 3.62 with
    single experts; balance ratio (max / mean rank load) 1.181 with groups, 1.019 with single
    experts, 1.012 global; pinned slightly above."""
    from megatron_moe.moe.router import top_k_gating

    groups, group_topk, num_experts, nodes, ranks_per_node = 8, 2, 64, 4, 4
    gen = torch.Generator().manual_seed(0)
    skew = -torch.log(torch.arange(1.0, num_experts + 1))[torch.randperm(num_experts, generator=gen)]
    logits = skew + torch.randn(4096, num_experts, generator=gen)
    _, expert_ids, _ = top_k_gating(logits, 8, score_function="sigmoid", groups=groups, group_topk=group_topk)
    load = np.bincount(expert_ids.ravel().numpy(), minlength=num_experts).astype(float)
    ranks, slots = nodes * ranks_per_node, num_experts // (nodes * ranks_per_node) + 1
    grouped = rebalance(load, ranks, slots, ranks_per_node, groups)
    single = rebalance(load, ranks, slots, ranks_per_node)
    spans = {name: _nodes_per_token(plan[0], ranks_per_node, expert_ids.numpy())
             for name, plan in (("groups", grouped), ("single", single))}
    ratios = {"groups": balance_ratio(load, *grouped), "single": balance_ratio(load, *single),
              "global": balance_ratio(load, *rebalance(load, ranks, slots))}
    assert spans["groups"].max() == group_topk and spans["groups"].mean() <= 1.95
    assert spans["single"].max() == nodes and spans["single"].mean() >= 3.6
    assert ratios["single"] <= 1.02 and ratios["global"] <= 1.015 and 1.17 <= ratios["groups"] <= 1.19


def _auto_decision(group_topk, top_k=4, groups=4, experts=16, ep=4, per_node=2):
    """`moe.eplb.hierarchical: auto` on a validated config: EP ranks per node of the hierarchical
    plan, or None for the global plan (ep ranks over nodes of `per_node`)."""
    cfg = load_config(None, [f"moe.num_experts={experts}", f"moe.top_k={top_k}", f"moe.router_groups={groups}",
                             f"moe.router_group_topk={group_topk}", "moe.balancer=eplb",
                             f"moe.eplb.redundant_slots={ep}", f"parallel.expert={ep}",
                             f"parallel.ranks_per_node={per_node}", "training.global_batch_size=32"])
    validate_config(cfg, ep)
    return planned_ranks_per_node(cfg, ep, per_node)


def test_auto_plans_globally_when_groups_limit_no_token_to_fewer_nodes():
    """Issue 42 item 5: 16 experts in 4 router groups, router_group_topk 4 (= router_groups: routing
    limits nothing), top-4, 2 nodes x 2 EP ranks, +4 slots (5 per rank). `auto` must plan globally:
    the hierarchical plan only coarsens the packing. 200 layers' loads, each 4096 rows drawn from a
    Zipf(1.0) popularity over a random expert order (seed 0). Measured mean balance (max / mean rank
    load): 1.0110 global against 1.1448 hierarchical (which `auto` gave before the fix)."""
    auto = _auto_decision(group_topk=4)
    assert auto is None
    assert _auto_decision(group_topk=2) is None  # 2 groups per token on 2 nodes: still both nodes
    assert _auto_decision(group_topk=2, groups=8, experts=32, ep=8, per_node=2) == 2  # 2 of 4 nodes
    assert _auto_decision(group_topk=2, top_k=2, groups=8, experts=32, ep=8, per_node=2) is None  # top-2: <= 2 anyway
    rng = np.random.default_rng(0)
    popularity = 1.0 / np.arange(1, 17)
    ratios = {"auto": [], "hierarchical": []}
    for _ in range(200):
        load = rng.multinomial(4096, rng.permutation(popularity / popularity.sum())).astype(float)
        ratios["auto"].append(balance_ratio(load, *rebalance(load, 4, 5, auto, 4)))
        ratios["hierarchical"].append(balance_ratio(load, *rebalance(load, 4, 5, 2, 4)))
    assert statistics.mean(ratios["auto"]) == pytest.approx(1.0110, abs=5e-4)
    assert statistics.mean(ratios["hierarchical"]) == pytest.approx(1.1448, abs=5e-4)


def test_auto_stays_hierarchical_when_routing_limits_nodes():
    """The same shape with router_group_topk 1 (< min(top_k 4, 2 nodes)): a token's experts lie in
    one group, so `auto` plans hierarchically and every token's experts sit in one node; the global
    plan spreads each group over both nodes. 4096 tokens routed by the router's own group-limited
    top-4 (sigmoid, Zipf(1.0)-skewed logits). Measured: tokens whose experts no single node holds:
    0 of 4096 hierarchical, 4096 of 4096 global; balance 1.178 against 1.000 (the price of locality)."""
    from megatron_moe.moe.router import top_k_gating

    per_node = _auto_decision(group_topk=1)
    assert per_node == 2
    gen = torch.Generator().manual_seed(0)
    logits = -torch.log(torch.arange(1.0, 17))[torch.randperm(16, generator=gen)] + torch.randn(4096, 16, generator=gen)
    _, expert_ids, _ = top_k_gating(logits, 4, score_function="sigmoid", groups=4, group_topk=1)
    load = np.bincount(expert_ids.ravel().numpy(), minlength=16).astype(float)
    plans = {"auto": rebalance(load, 4, 5, per_node, 4), "global": rebalance(load, 4, 5)}
    crossing = {}
    for name, (slot_to_expert, _) in plans.items():
        nodes = [set(slot_to_expert[n * 2:(n + 1) * 2].ravel().tolist()) for n in range(2)]
        crossing[name] = sum(not any(set(row) <= held for held in nodes) for row in expert_ids.tolist())
    assert crossing == {"auto": 0, "global": 4096}
    assert balance_ratio(load, *plans["auto"]) == pytest.approx(1.178, abs=1e-3)
    assert balance_ratio(load, *plans["global"]) == pytest.approx(1.0, abs=1e-3)


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
    ((np.arange(8.0), 4, 2, 1, 2), "2 router groups do not divide evenly over 4 nodes"),
    ((np.arange(8.0), 4, 3, 2, 3), "3 router groups do not divide 8 experts"),
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
