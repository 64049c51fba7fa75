"""Persistent vExperts (moe/vexperts.py, techniques/eplb/eplb.py, techniques/flexmoe/flexmoe.py, Placement.on_slots):
the pure pieces, no process groups. Slot tables, transfer plans and integer routing on hand-worked
examples, plus random checks against small brute-force references."""
import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from megatron_moe.config import ConfigError, load_config, validate_config
from megatron_moe.techniques.eplb.eplb import eplb_slots_per_rank, keep_in_place
from megatron_moe.techniques.flexmoe.flexmoe import flexmoe_slots_per_rank
from megatron_moe.techniques.flexmoe.flexmoe_plan import flexible_routing
from megatron_moe.moe.load_plots import figure_rgb, placement_figure
from megatron_moe.moe.placement import Placement
from megatron_moe.distributed.parallel_state import ParallelState, RankLayout
from megatron_moe.model.precision import cast_params_
from megatron_moe.moe.experts import Experts
from megatron_moe.training.mixed_precision import MixedPrecisionAdamW
from megatron_moe.moe.vexpert_moves import Transfer, plan_transfers, reshape_storage
from megatron_moe.moe.vexperts import SlotTable, expert_rows, grad_chunks, grad_sum_traffic, integer_routing
from tests.dense_reference import dense_flexible_routing, dense_integer_routing
from tests.unit.test_flexmoe_plan import _random_slots

TINY = "configs/gpt_moe_tiny.yaml"  # num_experts 8


def _random_shape(rng):
    num_ranks, slots_per_rank = int(rng.integers(2, 5)), int(rng.integers(2, 5))
    return num_ranks, slots_per_rank, int(rng.integers(1, num_ranks * slots_per_rank + 1))


# -- SlotTable ------------------------------------------------------------------------------------
def test_initial_layout():
    table = SlotTable.initial(num_experts=8, ep_size=2, slots_per_rank=5, ep_rank=1)
    assert table.slots.tolist() == [[0, 1, 2, 3, -1], [4, 5, 6, 7, -1]]
    assert table.shape == (2, 5) and table.ep_rank == 1
    assert table.resident(0) == [0, 1, 2, 3] and table.resident(1) == [4, 5, 6, 7]
    assert table.copies().tolist() == [1] * 8 and table.extra_vexperts == 0
    # no free slot: V = E / ep
    assert SlotTable.initial(6, 3, 2, 0).slots.tolist() == [[0, 1], [2, 3], [4, 5]]


@pytest.mark.parametrize("slots,needle", [
    ([[0, 1], [1, -1]], "[2]"),  # expert 2 has no copy
    ([[0, 1], [2, 3]], "[-1, 3)"),  # id 3 out of range for E = 3
    ([[0, 1], [2, -2]], "[-1, 3)"),  # below -1
    ([0, 1, 2], "[ep, V]"),  # 1-D
    ([[[0, 1, 2]]], "[ep, V]"),  # 3-D
])
def test_checked_rejects(slots, needle):
    with pytest.raises(ValueError) as e:
        SlotTable(np.array(slots), num_experts=3, ep_rank=0)
    assert needle in str(e.value)
    SlotTable(np.array([[0, 1], [2, -1]]), num_experts=3, ep_rank=0)  # the valid neighbour passes


def test_resident_holders_copies_with_duplicates_and_free_slots():
    table = SlotTable(np.array([[5, -1, 3, 5], [0, 1, 2, 4]]), num_experts=6, ep_rank=0)
    assert table.resident(0) == [3, 5] and table.resident(1) == [0, 1, 2, 4]
    assert table.holders().astype(int).tolist() == [[0, 0, 0, 1, 0, 1], [1, 1, 1, 0, 1, 0]]
    assert table.copies().tolist() == [1, 1, 1, 1, 1, 2]  # vExperts: 5 twice (on one rank)
    assert table.extra_vexperts == 1  # 7 filled slots, 6 experts


# rank 0: a co-located duplicate of 5 and a free slot; rank 1: a replica of 3; rank 2: replicas of 5, 0
THREE_RANKS = np.array([[5, -1, 3, 5], [0, 3, 2, 4], [1, 5, -1, 0]])


def test_canonical_rows_first_holder_in_rank_order():
    tables = [SlotTable(THREE_RANKS, 6, q) for q in range(3)]
    rows = [t.canonical_rows(q) for q, t in enumerate(tables)]
    assert all(m.dtype == torch.bool for m in rows)
    # rank 0 rows [3, 5]: both first; rank 1 rows [0, 2, 3, 4]: 3 is rank 0's; rank 2 rows [0, 1, 5]:
    # 0 is rank 1's, 5 rank 0's
    assert [m.tolist() for m in rows] == [[True, True], [True, True, False, True], [False, True, False]]
    # a per-row quantity (say a squared norm (e + 1)^2) summed over the masked rows counts each expert once
    per_row = [torch.tensor([(e + 1.0) ** 2 for e in t.resident(q)]) for q, t in enumerate(tables)]
    assert sum(float(v[m].sum()) for v, m in zip(per_row, rows)) == 91.0  # 1 + 4 + ... + 36
    assert sum(float(v.sum()) for v in per_row) != 91.0  # without the mask the copies count again
    assert tables[0].copies().tolist() == [2, 1, 1, 2, 1, 3]
    assert tables[0].extra_vexperts == 4  # 10 filled slots - 6 experts


def test_canonical_rows_random_counts_each_expert_once():
    rng = np.random.default_rng(7)
    for _ in range(20):
        num_ranks, per_rank, num_experts = _random_shape(rng)
        slots = _random_slots(rng, num_ranks, per_rank, num_experts)
        table = SlotTable(slots, num_experts, 0)
        hits = np.zeros(num_experts, dtype=np.int64)
        for q in range(num_ranks):
            mask = table.canonical_rows(q).numpy()
            assert mask.shape == (len(set(slots[q][slots[q] >= 0].tolist())),)
            np.add.at(hits, np.array(table.resident(q), dtype=np.int64)[mask], 1)
        assert hits.tolist() == [1] * num_experts
        assert table.copies().tolist() == [int((slots == e).sum()) for e in range(num_experts)]


def test_expert_rows_one_per_expert_held():
    assert expert_rows(SlotTable(THREE_RANKS, 6, 0)) == [(0, 3), (1, 5)]  # 5's two vExperts: one row
    assert expert_rows(SlotTable(THREE_RANKS, 6, 1)) == [(0, 0), (1, 2), (2, 3), (3, 4)]
    assert expert_rows(SlotTable(THREE_RANKS, 6, 2)) == [(0, 0), (1, 1), (2, 5)]


# -- storage: one copy per expert and rank ---------------------------------------------------------------
def test_k_vexperts_of_one_expert_on_a_rank_store_one_copy():
    """FlexMoE §3.1: a rank holding k vExperts of an expert stores one row of each parameter (one
    row of each AdamW moment, one gradient); free slots store nothing. Expert bytes per rank =
    distinct experts held x one expert's bytes, whatever the slot count."""
    cfg = load_config(TINY, ["moe.balancer=eplb", "moe.eplb.redundant_slots=4"])  # 12 slots on one rank
    state = ParallelState.build(RankLayout(world_size=1), 0)
    experts = Experts(cfg, state, slots_per_rank=12)
    one = sum(p[0].numel() * p.element_size() for p in experts.stacks())  # one expert's weights
    assert [p.shape[0] for p in experts.stacks()] == [8] * len(experts.stacks())  # 8 experts, 4 free slots
    slots = np.array([[0, 1, 2, 3, 4, 5, 6, 7, 7, 7, 7, -1]])  # expert 7 has 4 vExperts, one slot free
    reshape_storage(experts, slots)
    assert experts.slot_table.copies()[7] == 4 and [p.shape[0] for p in experts.stacks()] == [8] * 4
    assert sum(p.numel() * p.element_size() for p in experts.stacks()) == 8 * one
    optimizer = torch.optim.AdamW(experts.parameters(), lr=0.1)
    for p in experts.stacks():
        p.grad = torch.ones_like(p)
    optimizer.step()
    moments = [optimizer.state[p][key] for p in experts.stacks() for key in ("exp_avg", "exp_avg_sq")]
    assert sum(t.numel() * t.element_size() for t in moments) == 2 * 8 * one
    reshape_storage(experts, np.array([[0, 1, 2, 3, 4, 5, 6, 7, -1, -1, -1, -1]]), optimizer)  # Shrinks: tags
    assert [p.shape[0] for p in experts.stacks()] == [8] * 4 and experts.slot_table.copies()[7] == 1
    reshape_storage(experts, np.array([[0, 1, 2, 3, 4, 5, 6, 7, 7, -1, -1, 0]]), optimizer)  # Expands: shared
    assert [p.shape[0] for p in experts.stacks()] == [8] * 4
    assert [optimizer.state[p]["exp_avg"].shape[0] for p in experts.stacks()] == [8] * 4


def test_storage_rows_follow_the_experts_held_with_bf16_masters_and_main_grads():
    """Rows of experts a rank keeps keep their values (weights, fp32 masters); rows it gains start
    at zero (a checkpoint load fills them); a bf16 main gradient is a buffer of its own,
    re-allocated with the stack and zeroed with the others."""
    cfg = load_config(TINY, ["moe.balancer=eplb", "moe.eplb.redundant_slots=0"])
    state = ParallelState.build(RankLayout(world_size=1), 0)
    experts = cast_params_(Experts(cfg, state, slots_per_rank=8), "bf16")
    for p in experts.stacks():
        p.data.copy_(torch.arange(1.0, 9.0).view(8, *[1] * (p.dim() - 1)).expand_as(p))  # expert e's row holds e + 1
    optimizer = MixedPrecisionAdamW([{"params": list(experts.parameters()), "weight_decay": 0.0}],
                                    lr=0.1, betas=(0.9, 0.95), eps=1e-8)
    assert all(p.main_grad.shape == p.shape for p in experts.stacks()) and not optimizer.main_grads.buffers
    table = experts.slot_table  # as rank 0 of two EP ranks: rank 1 holds 4-7 from now on
    table.slots = table.checked(np.array([list(range(8)), [4, 5, 6, 7] + [-1] * 4]))
    reshape_storage(experts, np.array([[0, 1, 2, 3, 3, 3, -1, -1], [4, 5, 6, 7] + [-1] * 4]), optimizer)
    assert [p.shape[0] for p in experts.stacks()] == [4] * 4  # 4 distinct experts (3 of them twice)
    for p in experts.stacks():
        assert p.float().flatten(1)[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0]
        assert optimizer.state[p]["master"].flatten(1)[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0]
        assert p.main_grad.shape == p.shape and optimizer.state[p]["exp_avg"].shape == p.shape
    reshape_storage(experts, np.array([[0, 1, 2, 3, 6, 6, -1, -1], [4, 5, 6, 7] + [-1] * 4]), optimizer)
    for p in experts.stacks():  # expert 6 joins: rows [0, 1, 2, 3, 6], the new one zero until loaded
        assert p.float().flatten(1)[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0, 0.0]
    experts.w1.main_grad.fill_(1.0)
    optimizer.zero_grad()
    assert float(experts.w1.main_grad.abs().sum()) == 0.0


# -- plan_transfers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(20))
def test_gradient_sum_moves_a_ring_all_reduce_volume_among_the_holders(seed):
    """Every holder of an expert on k ranks sums one chunk (the chunks tile the gradient) and
    sends and receives 2 (k - 1) / k of it over both rounds, up to the chunks' rounding (Eq. 9's
    ring among the holders); a rank holding no replicated expert takes no part."""
    rng = np.random.default_rng(seed)
    ep, E, width = int(rng.integers(2, 9)), 8, int(rng.integers(1, 40))
    slots = _random_slots(rng, ep, -(-E // ep) + int(rng.integers(1, 4)), E)
    held = [set(row[row >= 0].tolist()) for row in slots]
    P = grad_sum_traffic(slots, E, width)
    sent, received = P.sum(1) + P.T.sum(1), P.sum(0) + P.T.sum(0)  # round 1 + round 2 (the transpose)
    want = np.zeros(ep)
    for e in range(E):
        ranks = [q for q in range(ep) if e in held[q]]
        k = len(ranks)
        if k < 2:
            continue
        chunks = grad_chunks(e, ranks, width)
        assert [c[0] for c in chunks] == [0] + [c[1] for c in chunks[:-1]] and chunks[-1][1] == width
        assert sorted(c[2] for c in chunks) == ranks  # one chunk per holder
        for start, stop, root in chunks:
            want[ranks] += stop - start  # each holder sends its part, or receives k - 1 parts ...
            want[root] += (k - 2) * (stop - start)  # ... and the root sends the sum k - 1 times
        assert max(stop - start for start, stop, _ in chunks) - min(stop - start for start, stop, _ in chunks) <= 1
    np.testing.assert_array_equal(sent, want)
    np.testing.assert_array_equal(received, want)
    shared = {e for e in range(E) if sum(e in h for h in held) > 1}
    assert all(sent[q] == 0 for q in range(ep) if not held[q] & shared)


def test_plan_transfers_nothing_for_experts_a_rank_keeps():
    old = np.array([[0, 2, 0, -1], [1, 2, 3, -1]])
    # rank 0 gets a third vExpert of 0, rank 1 a second of 2: shared rows, nothing moves
    assert plan_transfers(old, np.array([[0, 2, 0, 0], [1, 2, 3, 2]])) == []
    # slots shuffled within the ranks: nothing moves either
    assert plan_transfers(old, np.array([[-1, 0, 2, 0], [3, -1, 1, 2]])) == []


def test_plan_transfers_spreads_sources_then_lowest_rank():
    # expert 0 on ranks 0 and 1; ranks 2 and 3 gain it: first from rank 0 (tie), then rank 1
    old = np.array([[0, 1], [0, 2], [3, -1], [1, -1]])
    new = np.array([[0, 1], [0, 2], [3, 0], [1, 0]])
    assert plan_transfers(old, new) == [Transfer(0, 0, 2), Transfer(0, 1, 3)]
    # the load counts across experts: rank 2 gains 0 and 1 (ascending): 0 from rank 0 (tie),
    # then 1 from rank 1 (fewer sent)
    old = np.array([[0, 1, -1], [1, 0, 0], [2, -1, -1]])
    new = np.array([[0, 1, -1], [1, 0, 0], [2, 1, 0]])
    assert plan_transfers(old, new) == [Transfer(0, 0, 2), Transfer(1, 1, 2)]
    # gaining two vExperts of one expert is one transfer
    old = np.array([[0, 1, -1], [2, -1, -1]])
    assert plan_transfers(old, np.array([[0, 1, -1], [2, 0, 0]])) == [Transfer(0, 0, 1)]


def test_plan_transfers_nothing_for_freed_or_unchanged_cells():
    old = np.array([[0, 1, 1], [2, 3, -1]])
    assert plan_transfers(old, old.copy()) == []
    assert plan_transfers(old, np.array([[0, 1, -1], [2, 3, -1]])) == []  # Shrink
    # a Migrate: rank 0 gains 3 from rank 1, rank 1 gains 1 from rank 0
    got = plan_transfers(old, np.array([[0, -1, 3], [2, -1, 1]]))
    assert got == [Transfer(3, 1, 0), Transfer(1, 0, 1)]


def test_plan_transfers_random_reaches_new_table():
    rng = np.random.default_rng(1)
    for _ in range(50):
        num_ranks, per_rank, num_experts = _random_shape(rng)
        old = _random_slots(rng, num_ranks, per_rank, num_experts)
        new = _random_slots(rng, num_ranks, per_rank, num_experts)
        if rng.random() < 0.3:  # some pairs differ in a few cells only
            new = old.copy()
            q, k = int(rng.integers(num_ranks)), int(rng.integers(per_rank))
            new[q, k] = int(rng.integers(-1, num_experts))
            if not np.isin(np.arange(num_experts), new).all():  # would leave an expert without a copy
                new = old.copy()
        transfers = plan_transfers(old, new)
        held = [set(old[q][old[q] >= 0].tolist()) for q in range(num_ranks)]
        for t in transfers:
            assert t.expert in held[t.src_rank] and t.src_rank != t.dst_rank  # from an old holder
        gained = sorted((q, e) for q in range(num_ranks) for e in set(new[q][new[q] >= 0].tolist()) - held[q])
        assert sorted((t.dst_rank, t.expert) for t in transfers) == gained  # exactly what each rank gains, once


# -- integer_routing -----------------------------------------------------------------------------------
def _route(fractions, counts, allowed=None):
    fractions = np.asarray(fractions, dtype=np.float64)
    if allowed is None:
        allowed = np.ones(fractions.shape[1:], dtype=bool)
    return _route_pairs(fractions, counts, np.asarray(allowed)).tolist()


def _route_pairs(fractions, counts, allowed):
    """`integer_routing` of the dense `fractions` [S, E, ep] on the `allowed` [E, ep] pairs."""
    experts, ranks = np.nonzero(allowed)
    return integer_routing(fractions[:, experts, ranks], np.asarray(counts), experts, ranks, allowed.shape[1])


def test_integer_routing_by_hand():
    # floors [0, 1, 1], one row left -> the largest fractional part (rank 0)
    assert _route([[[0.5, 1.25, 1.25]]], [[3]]) == [[[1, 1, 1]]]
    # ties go to the lower rank
    assert _route([[[0.5, 0.5]]], [[1]]) == [[[1, 0]]]
    assert _route([[[1.5, 0.5, 1.0]]], [[3]]) == [[[2, 0, 1]]]
    assert _route([[[0.6, 0.7, 0.7]]], [[2]]) == [[[0, 1, 1]]]
    # a rank not allowed gets nothing, even with a fraction there; its row goes to the allowed ones
    assert _route([[[0.9, 0.4, 0.4, 0.3]]], [[2]], [[False, True, True, True]]) == [[[0, 1, 1, 0]]]
    assert _route([[[1.2, 0.4, 0.4]]], [[1]], [[False, True, True]]) == [[[0, 1, 0]]]
    # float noise around whole numbers
    assert _route([[[1 - 1e-13, 1 + 1e-13, 1.0]]], [[3]]) == [[[1, 1, 1]]]
    # several sources and experts at once (S = 2, E = 2, ep = 2)
    fractions = [[[2.5, 0.5], [0.0, 4.0]], [[1.2, 1.8], [0.25, 0.75]]]
    assert _route(fractions, [[3, 4], [3, 1]]) == [[[3, 0], [0, 4]], [[1, 2], [0, 1]]]


def _reference_rounding(fractions, counts, allowed):
    """Largest remainder per (s, e) in plain Python: floors, then +1 by fractional part, lower rank first."""
    out = np.zeros(fractions.shape, dtype=np.int64)
    num_sources, num_experts, num_ranks = fractions.shape
    for s in range(num_sources):
        for e in range(num_experts):
            ranks = [q for q in range(num_ranks) if allowed[e, q]]
            f = {q: max(float(fractions[s, e, q]), 0.0) for q in ranks}
            for q in ranks:
                out[s, e, q] = int(np.floor(f[q]))
            left = int(counts[s, e]) - sum(int(out[s, e, q]) for q in ranks)
            for q in sorted(ranks, key=lambda q: (-(f[q] - np.floor(f[q])), q))[:left]:
                out[s, e, q] += 1
    return out


def test_integer_routing_random_flexible_routing():
    rng = np.random.default_rng(3)
    for _ in range(30):
        num_ranks, per_rank, num_experts = _random_shape(rng)
        slots = _random_slots(rng, num_ranks, per_rank, num_experts)
        num_sources = int(rng.integers(1, 5))
        counts = rng.integers(0, 30, size=(num_sources, num_experts))
        sources = rng.integers(0, num_ranks, size=num_sources).tolist()
        held = np.zeros((num_experts, num_ranks), dtype=bool)
        for q in range(num_ranks):
            held[slots[q][slots[q] >= 0], q] = True
        routing = flexible_routing(counts, sources, slots)
        fractions = dense_flexible_routing(counts, sources, slots)
        table = integer_routing(routing.values, counts, routing.experts, routing.ranks, num_ranks)
        assert table.dtype == torch.int64 and tuple(table.shape) == fractions.shape
        t = table.numpy()
        assert np.array_equal(t.sum(2), counts)
        assert (t[:, ~held] == 0).all()
        assert (np.abs(t - fractions) < 1 + 1e-9).all()
        assert ((t == np.floor(fractions + 1e-9)) | (t == np.ceil(fractions - 1e-9))).all()
        assert np.array_equal(t, _reference_rounding(fractions, counts, held))
        assert torch.equal(table, integer_routing(routing.values.copy(), counts, routing.experts, routing.ranks,
                                                  num_ranks))  # deterministic
        # what SlotBalancer.plan does with it: every row lands on a holder
        placement = Placement.on_slots(table, [SlotTable(slots, num_experts, 0).resident(q)
                                               for q in range(num_ranks)])
        assert int(placement.tokens_per_ep_rank().sum()) == int(counts.sum())
        assert torch.equal(placement.source_rows()[1], table.sum(1))  # the pairs hold every row


@pytest.mark.parametrize("seed", range(2))
def test_integer_routing_on_pairs_equals_the_dense_rounding(seed):
    # many random cases, with exact ties (fractions on a grid of quarters) and float noise, against
    # the dense sort over every rank: the same table
    rng = np.random.default_rng(100 + seed)
    for case in range(150):
        num_sources, num_experts, ep = int(rng.integers(1, 7)), int(rng.integers(1, 9)), int(rng.integers(1, 9))
        allowed = rng.random((num_experts, ep)) < rng.uniform(0.1, 1.0)
        allowed[np.arange(num_experts), rng.integers(0, ep, num_experts)] = True  # every expert held
        counts = rng.integers(0, 25, size=(num_sources, num_experts))
        weights = np.where(allowed[None], rng.random((num_sources, num_experts, ep)), 0.0)
        if case % 3 == 0:  # exact ties
            weights = np.where(allowed[None], rng.integers(1, 4, (num_sources, num_experts, ep)), 0.0)
        weights[weights.sum(2) == 0, :] = allowed[np.nonzero(weights.sum(2) == 0)[1]]
        fractions = counts[:, :, None] * weights / weights.sum(2, keepdims=True)
        if case % 3 == 1:  # float noise around the exact split
            fractions = fractions + np.where(allowed[None], rng.normal(0, 1e-12, fractions.shape), 0.0)
        expected = dense_integer_routing(fractions, counts, allowed)
        assert np.array_equal(expected.sum(2), counts)  # (the dense reference places every row here too)
        assert np.array_equal(_route_pairs(fractions, counts, allowed).numpy(), expected)
    # bad pairs: unordered, repeated
    with pytest.raises(ValueError, match="ascending"):
        integer_routing(np.ones((1, 2)), np.array([[2]]), np.array([0, 0]), np.array([1, 0]), 2)
    with pytest.raises(ValueError, match="ascending"):
        integer_routing(np.ones((1, 2)), np.array([[2]]), np.array([0, 0]), np.array([1, 1]), 2)
    with pytest.raises(RuntimeError, match="did not place every row"):  # more rows than the pairs' fractions
        integer_routing(np.array([[0.5, 0.5]]), np.array([[3]]), np.array([0, 0]), np.array([0, 1]), 2)


# -- Placement.on_slots ----------------------------------------------------------------------------------
def test_placement_on_slots_with_replica_and_duplicate():
    # rank 0 holds 1 twice (a duplicate) and a replica of 3; rank 1 a replica of 0
    table = SlotTable(np.array([[0, 1, 1, 3], [2, 3, 0, -1]]), num_experts=4, ep_rank=0)
    routing = torch.zeros(2, 4, 2, dtype=torch.long)
    routing[0, 0] = torch.tensor([2, 1])
    routing[0, 1, 0] = 1
    routing[0, 3] = torch.tensor([1, 1])
    routing[1, 2, 1] = 4
    routing[1, 3, 1] = 2
    placement = Placement.on_slots(routing, [table.resident(q) for q in range(2)])
    assert placement.resident == ((0, 1, 3), (0, 2, 3))
    assert placement.replicas == ((0, 1), (0,), (1,), (0, 1))
    assert placement.experts_on(0) == [0, 1, 3] and placement.experts_on(1) == [0, 2, 3]
    assert placement.replicas_on(0) == [] and placement.replicas_on(1) == []
    assert placement.transient_replicas() == ((0,), (0,), (1,), (0,))
    assert placement.num_replicas == 2
    assert placement.expert_counts(0) == [2, 1, 1] and placement.expert_counts(1) == [1, 4, 3]
    assert placement.destinations(0).tolist() == [0, 0, 1, 0, 0, 1]  # experts ascending, holders in order
    # resident given unsorted and with duplicates (a raw slot row) is normalised
    again = Placement.on_slots(routing, [[3, 1, 0, 1], [3, 0, 2]])
    assert again.resident == placement.resident and again.replicas == placement.replicas


def test_placement_default_resident_is_owners_layout():
    counts = torch.tensor([[1, 2, 3, 4]])
    plain = Placement.owner_only(counts, ep_size=2)
    assert plain.resident == ((0, 1), (2, 3))
    assert plain.experts_on(0) == [0, 1] and plain.experts_on(1) == [2, 3]
    shadowed = Placement.shadowed(counts, 2, shadowed=[0], source_ep_ranks=[1])
    assert shadowed.resident == ((0, 1), (2, 3))
    assert shadowed.experts_on(1) == [2, 3, 0] and shadowed.replicas_on(1) == [0]
    assert shadowed.transient_replicas() == shadowed.replicas == ((0, 1), (0,), (1,), (1,))
    assert shadowed.num_replicas == 1


def test_placement_rejects_non_holders():
    zeros = torch.zeros(1, 2, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="replicas of expert 0"):
        Placement(((1,), (1,)), zeros)  # owners: rank 0 holds 0
    with pytest.raises(ValueError, match="replicas of expert 0"):
        Placement(((1, 0), (1,)), zeros, resident=((0,), (1,)))  # a holder, but not first
    Placement(((0, 1), (1,)), zeros, resident=((0,), (1,)))  # the holder first is fine
    with pytest.raises(ValueError, match="ascending"):
        Placement(((0,), (1,)), zeros, resident=((1, 0), ()))
    routing = torch.zeros(1, 2, 2, dtype=torch.long)
    routing[0, 1, 0] = 1  # expert 1 only lives on rank 1
    with pytest.raises(ValueError, match="no replica"):
        Placement.on_slots(routing, [[0], [1]])
    with pytest.raises(ValueError):
        Placement.on_slots(zeros, [[0], [0]])  # expert 1 held nowhere


# -- EPLB / FlexMoE helpers --------------------------------------------------------------------------------
def test_keep_in_place_by_hand():
    old = np.array([[0, 1, 2, -1], [3, 4, 5, -1]])
    plan = np.array([[5, 5, 1, 3], [4, 0, 2, 4]])
    # rank 0 keeps 1 in slot 1, then [3, 5, 5] fill slots 0, 2, 3; rank 1 keeps 4 in slot 1, then [0, 2, 4]
    assert keep_in_place(old, plan).tolist() == [[3, 1, 5, 5], [0, 4, 2, 4]]
    # an expert held twice keeps only its first slot when the plan has it once
    assert keep_in_place(np.array([[4, 4, 0, 1]]), np.array([[1, 2, 3, 4]])).tolist() == [[4, 2, 3, 1]]
    assert keep_in_place(old[:, :3], np.array([[2, 1, 0], [5, 4, 3]])).tolist() == [[0, 1, 2], [3, 4, 5]]


def test_keep_in_place_random():
    rng = np.random.default_rng(5)
    for _ in range(30):
        num_ranks, per_rank, num_experts = _random_shape(rng)
        old = _random_slots(rng, num_ranks, per_rank, num_experts)
        plan = rng.integers(0, num_experts, size=(num_ranks, per_rank))  # EPLB fills every slot
        placed = keep_in_place(old, plan)
        for q in range(num_ranks):
            assert sorted(placed[q].tolist()) == sorted(plan[q].tolist())
            kept = placed[q] == old[q]
            overlap = sum(min(int((old[q] == e).sum()), int((plan[q] == e).sum())) for e in range(num_experts))
            assert int(kept.sum()) == overlap  # every expert it can keep stays in its slot
            rest = placed[q][~kept].tolist()
            assert rest == sorted(rest)


def test_slots_per_rank_defaults():
    cfg = load_config(TINY, ["parallel.expert=2"])
    assert eplb_slots_per_rank(cfg, 2) == 5  # (8 + 2) / 2
    assert eplb_slots_per_rank(cfg, 1) == 8  # one rank: no redundant slot
    assert flexmoe_slots_per_rank(cfg, 2) == 5  # 8 / 2 + 1
    cfg = load_config(TINY, ["parallel.expert=2", "moe.eplb.redundant_slots=4", "moe.flexmoe.slots_per_rank=7"])
    assert eplb_slots_per_rank(cfg, 2) == 6 and flexmoe_slots_per_rank(cfg, 2) == 7


# -- config validation --------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides,needle", [
    (["moe.balancer=flexmoe", "moe.flexmoe.threshold=0.9"], "moe.flexmoe.threshold=0.9"),
    (["moe.balancer=flexmoe", "moe.flexmoe.interval=0"], "moe.flexmoe.interval=0"),
    (["moe.balancer=flexmoe", "moe.flexmoe.moves=async"], "moe.flexmoe.moves=async must be one of sync, best_effort"),
])
def test_vexpert_config_errors(overrides, needle):
    cfg = load_config(TINY, ["parallel.expert=2"] + overrides)
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, 2)
    assert needle in str(e.value) and "\n" not in str(e.value)


NULL2 = "(or null = 2)"  # moe.eplb.redundant_slots: null = one redundant slot per EP rank


@pytest.mark.parametrize("world,overrides,message", [
    # issue 43 item 11: each broken rule alone, with the nearest valid values (8 experts)
    (2, ["moe.eplb.redundant_slots=1"], "moe.eplb.redundant_slots=1: moe.num_experts + redundant_slots = 9 slots do "
                                        f"not divide over parallel.expert=2 ranks; use 0 or 2 {NULL2}"),
    (4, ["moe.eplb.redundant_slots=6"], "moe.eplb.redundant_slots=6: moe.num_experts + redundant_slots = 14 slots do "
                                        "not divide over parallel.expert=4 ranks; use 4 or 8 (or null = 4)"),
    (2, ["moe.eplb.redundant_slots=-2"], f"moe.eplb.redundant_slots=-2 is negative; use 0 (no replica) or more {NULL2}"),
    (2, ["moe.eplb.redundant_slots=-1"], f"moe.eplb.redundant_slots=-1 is negative; use 0 (no replica) or more {NULL2}"),
    (2, ["moe.eplb.redundant_slots=10"], "moe.eplb.redundant_slots=10: 18 slots over parallel.expert=2 ranks exceed "
                                         "moe.num_experts=8 per rank (a rank holds an expert at most once); use 8 or "
                                         f"less {NULL2}"),
    (2, ["moe.eplb.redundant_slots=9"], "moe.eplb.redundant_slots=9: 17 slots over parallel.expert=2 ranks exceed "
                                        "moe.num_experts=8 per rank (a rank holds an expert at most once); use 8 or "
                                        f"less {NULL2}"),
    (1, ["moe.eplb.redundant_slots=3"], "moe.eplb.redundant_slots=3: 11 slots over parallel.expert=1 ranks exceed "
                                        "moe.num_experts=8 per rank (a rank holds an expert at most once); use 0 "
                                        "(or null = 0)"),
    # the hierarchical plan keeps replicas in their node: at most E / nodes = 4 slots per rank (2 nodes x 2)
    (4, ["parallel.ranks_per_node=2", "moe.eplb.hierarchical=true", "moe.eplb.redundant_slots=12"],
     "moe.eplb.redundant_slots=12: 20 slots over parallel.expert=4 ranks exceed the 4 experts of a node per rank (the "
     "hierarchical plan keeps an expert's replicas in its node of 2 EP ranks, and a rank holds an expert at most "
     "once); use 8 or less (or null = 4), or moe.eplb.hierarchical=false"),
    (2, ["moe.eplb.interval=0"], "moe.eplb.interval=0 is below 1 (EPLB re-plans every `interval` iterations); use 1 "
                                 "(every iteration) or more"),
    (2, ["moe.eplb.ema=0"], "moe.eplb.ema=0.0: the newest window's weight in the moving average of the loads must be "
                            "> 0 (0 never updates them); use a weight in (0, 1], e.g. 0.5 (the default)"),
    (2, ["moe.eplb.ema=1.5"], "moe.eplb.ema=1.5: the newest window's weight in the moving average of the loads is at "
                              "most 1; use 1.0 (the newest window only) or less"),
    (2, ["moe.balancer=flexmoe", "moe.flexmoe.slots_per_rank=3"],
     "moe.flexmoe.slots_per_rank=3 must be >= moe.num_experts / parallel.expert = 4, the experts a rank starts with; "
     "use 4 or more (or null = 5)"),
])
def test_vexpert_config_messages(world, overrides, message):
    """One line per broken rule, naming only that rule and the nearest valid values."""
    cfg = load_config(TINY, ["moe.balancer=eplb", f"parallel.expert={world}",
                             f"training.global_batch_size={4 * world}"] + overrides)
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, world)
    assert str(e.value) == message


def test_eplb_suggested_values_are_valid():
    """Every value a redundant_slots message suggests passes (and the bounds they name are tight)."""
    for world, extra, bad, good in [(2, [], [1, 3, 7, 9, 10, -1], [0, 2, 4, 6, 8]), (4, [], [6, 25, -4], [4, 8, 24]),
                                    (1, [], [1, 3], [0]),
                                    (4, ["parallel.ranks_per_node=2", "moe.eplb.hierarchical=true"], [12, 10], [0, 8])]:
        base = ["moe.balancer=eplb", f"parallel.expert={world}", f"training.global_batch_size={4 * world}"] + extra
        for slots in good:
            validate_config(load_config(TINY, base + [f"moe.eplb.redundant_slots={slots}"]), world)
        for slots in bad:
            with pytest.raises(ConfigError) as e:
                validate_config(load_config(TINY, base + [f"moe.eplb.redundant_slots={slots}"]), world)
            suggested = [int(w) for w in str(e.value).split("; use ")[1].replace(",", " ").split()[:3] if w.isdigit()]
            assert suggested, str(e.value)
            for slots_ok in suggested:
                validate_config(load_config(TINY, base + [f"moe.eplb.redundant_slots={slots_ok}"]), world)


def test_eplb_node_bound_checked_at_start_up():
    """When the nodes come from the launcher (no parallel.ranks_per_node), the hierarchical plan's
    bound on the slots is checked when the balancer is built, before the first plan would fail."""
    from types import SimpleNamespace

    from megatron_moe.techniques.eplb.eplb import EPLB

    cfg = load_config(TINY, ["moe.balancer=eplb", "parallel.expert=4", "moe.eplb.hierarchical=true",
                             "moe.eplb.redundant_slots=12", "training.global_batch_size=16"])
    validate_config(cfg, 4)  # nodes unknown yet: the global bound (5 <= 8 slots per rank) holds
    state = SimpleNamespace(ep_size=4, ep=_Group([0, 1, 2, 3], 2))
    with pytest.raises(ConfigError, match=r"^moe.eplb.redundant_slots=12: 20 slots over parallel.expert=4 ranks "
                                          r"exceed the 4 experts of a node per rank"):
        EPLB(cfg, state)


def test_vexpert_config_valid_and_unused_sections_ignored():
    profile = "perf.hardware_profile=configs/hardware/cpu_gloo_2proc.yaml"
    for ov in (["moe.balancer=flexmoe", "moe.flexmoe.slots_per_rank=4", "moe.flexmoe.threshold=1.0", profile],
               ["moe.balancer=flexmoe", "moe.flexmoe.moves=best_effort", profile],
               ["moe.balancer=eplb", "moe.eplb.redundant_slots=2"],
               ["moe.balancer=eplb", "moe.eplb.redundant_slots=0", "moe.eplb.ema=1.0"],
               # the same bad values with no vExpert balancer: nobody reads them
               ["moe.balancer=none", "moe.eplb.redundant_slots=1", "moe.eplb.ema=0",
                "moe.flexmoe.slots_per_rank=1", "moe.flexmoe.threshold=0.5", "moe.flexmoe.moves=async"]):
        validate_config(load_config(TINY, ["parallel.expert=2"] + ov), 2)


def test_vexpert_config_other_balancers_section_ignored():
    validate_config(load_config(TINY, ["parallel.expert=2", "moe.balancer=flexmoe", "moe.eplb.ema=0"]), 2)


# -- placement_figure ------------------------------------------------------------------------------------------
def test_placement_figure_renders():
    slots = np.array([[0, 1, 2, 3, -1], [4, 5, 6, 7, -1]])
    fig = placement_figure(slots, layer_index=0, iteration=10)
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert ax.get_title() == "vExpert slots, layer 0, after iteration 10"
    assert [t.get_text() for t in ax.texts] == ["0", "1", "2", "3", "free", "4", "5", "6", "7", "free"]
    rgb = figure_rgb(fig)
    # figsize (max(4, 1.5 + 0.6 * 5), max(2.5, 1 + 0.45 * 2)) inches at 100 dpi
    assert rgb.shape == (250, 450, 3) and rgb.dtype == np.uint8
    assert len(np.unique(rgb.reshape(-1, 3), axis=0)) > 10  # something was drawn


class _Group:
    def __init__(self, ranks, ranks_per_node):
        self.ranks, self.ranks_per_node, self.size = ranks, ranks_per_node, len(ranks)

    def global_rank(self, index):
        return self.ranks[index]


class _State:
    def __init__(self, ranks, ranks_per_node):
        self.ep = _Group(ranks, ranks_per_node)


def test_ep_ranks_per_node_for_hierarchical_eplb():
    from megatron_moe.techniques.flexmoe.vexpert_base import ep_ranks_per_node

    assert ep_ranks_per_node(_State([0, 1, 2, 3], None)) is None  # one node
    assert ep_ranks_per_node(_State([0, 1, 2, 3], 4)) is None  # the whole group on one node
    assert ep_ranks_per_node(_State([0, 1, 2, 3], 2)) == 2  # nodes {0, 1}, {2, 3}
    assert ep_ranks_per_node(_State([0, 2, 4, 6], 4)) == 2  # strided group (tp = 2): 2 EP ranks per node
    assert ep_ranks_per_node(_State([0, 4, 1, 5], 4)) is None  # nodes interleaved: planned flat
    assert ep_ranks_per_node(_State([0, 1, 2, 4, 5, 8], 4)) is None  # unequal nodes


def test_eplb_hierarchical_modes():
    """`moe.eplb.hierarchical`: auto is global unless group-limited routing limits a token's nodes
    (`moe.router_group_topk` < min(top_k, nodes)); true follows the nodes; false never.
    Hierarchical plans pack the router's groups."""
    from types import SimpleNamespace

    from megatron_moe.config import ConfigError
    from megatron_moe.techniques.eplb.eplb import eplb_ranks_per_node, hierarchical_groups

    state = _State([0, 1, 2, 3], 2)  # two nodes of 2 EP ranks

    def cfg(mode, groups=1, group_topk=1):  # top-2 routing, a token's experts in 1 group
        return SimpleNamespace(moe=SimpleNamespace(eplb=SimpleNamespace(hierarchical=mode), router_groups=groups,
                                                   router_group_topk=group_topk, top_k=2, num_experts=12))

    assert eplb_ranks_per_node(cfg("auto"), state) is None
    assert eplb_ranks_per_node(cfg("auto", 2), state) == 2
    assert eplb_ranks_per_node(cfg("True"), state) == 2 and eplb_ranks_per_node(cfg("false", 2), state) is None
    assert eplb_ranks_per_node(cfg("true"), _State([0, 1, 2, 3], None)) is None  # one node: global
    # the groups the plan packs onto nodes: the router's, when they split evenly over the nodes
    assert hierarchical_groups(cfg("auto", 4), 4, 2) == 4 and hierarchical_groups(cfg("true"), 4, 2) == 1
    assert hierarchical_groups(cfg("false", 3), 4, None) == 3  # the global plan ignores them
    with pytest.raises(ConfigError) as e:
        hierarchical_groups(cfg("auto", 3), 4, 2)
    assert str(e.value) == ("moe.router_groups=3 does not divide evenly over the 2 nodes of the ep group (2 EP ranks "
                            "each), and hierarchical EPLB packs whole router groups onto nodes; use "
                            "moe.router_groups=2 or 4, or moe.eplb.hierarchical=false (plans globally)")
    # the suggestions obey the router's rules: 12 experts, 2 groups per token, top-8 -> groups of >= 4 experts
    with pytest.raises(ConfigError, match=r"; use moe.router_groups=2, or moe.eplb.hierarchical=false"):
        hierarchical_groups(SimpleNamespace(moe=SimpleNamespace(router_groups=3, router_group_topk=2, top_k=8,
                                                                num_experts=12)), 4, 2)
