"""Placement math: splits, destinations and receive order, owner-only and with a replica."""
import pytest
import torch

from megatron_moe.moe.placement import Placement, owner_of

COUNTS = torch.tensor([[3, 1, 0, 2], [1, 2, 2, 0]])  # 2 sources x 4 experts, ep = 2


def _exchange(placement: Placement, counts: torch.Tensor):
    """Simulate the all-to-all: rows labelled (source, expert, index within the source's expert
    rows), ordered and split as the placement says; returns each receiver's expert batch."""
    ep = placement.ep_size
    inbox = [[] for _ in range(ep)]
    for s in range(counts.shape[0]):
        rows = [(s, e, i) for e in range(counts.shape[1]) for i in range(int(counts[s, e]))]
        dest = placement.destinations(s).tolist()
        assert len(dest) == len(rows)
        for q in range(ep):  # send buffer: rows in destination order (stable), split per rank
            sent = [r for r, d in zip(rows, dest) if d == q]
            assert len(sent) == placement.send_splits(s)[q]
            inbox[q].extend(sent)
    batches = []
    for q in range(ep):
        assert [sum(1 for r in inbox[q] if r[0] == s) for s in range(counts.shape[0])] == placement.recv_splits(q)
        batches.append([inbox[q][i] for i in placement.receive_order(q).tolist()])
    return batches


def test_owner_only():
    assert [owner_of(e, 4, 2) for e in range(4)] == [0, 0, 1, 1]
    p = Placement.owner_only(COUNTS, ep_size=2)
    assert p.replicas == ((0,), (0,), (1,), (1,))
    assert p.send_splits(0) == [4, 2] and p.recv_splits(0) == [4, 3] and p.recv_splits(1) == [2, 2]
    assert p.experts_on(0) == [0, 1] and p.expert_counts(0) == [4, 3] and p.expert_counts(1) == [2, 2]
    assert p.tokens_per_ep_rank().tolist() == [7, 4]
    batches = _exchange(p, COUNTS)
    assert batches[0] == [(0, 0, 0), (0, 0, 1), (0, 0, 2), (1, 0, 0), (0, 1, 0), (1, 1, 0), (1, 1, 1)]
    assert batches[1] == [(1, 2, 0), (1, 2, 1), (0, 3, 0), (0, 3, 1)]


def test_replica_splits_an_experts_rows_in_replica_order():
    table = Placement.owner_only(COUNTS, ep_size=2).routing_table.clone()
    table[0, 0] = torch.tensor([2, 1])  # source 0: first 2 rows of expert 0 to the owner, the third to rank 1
    table[1, 0] = torch.tensor([0, 1])
    p = Placement(((0, 1), (0,), (1,), (1,)), table)
    # owned experts first (weights at hand), then the replica (weights moved in by Trans)
    assert p.experts_on(1) == [2, 3, 0] and p.replicas_on(1) == [0] and p.replicas_on(0) == []
    assert p.expert_counts(1) == [2, 2, 2] and p.expert_counts(0) == [2, 3] and p.num_replicas == 1
    batches = _exchange(p, COUNTS)
    assert batches[0] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 1, 0), (1, 1, 1)]
    assert batches[1] == [(1, 2, 0), (1, 2, 1), (0, 3, 0), (0, 3, 1), (0, 0, 2), (1, 0, 0)]
    assert p.tokens_per_ep_rank().tolist() == [5, 6]


def test_owned_experts_are_listed_even_without_rows():
    counts = torch.tensor([[0, 0, 1, 0]])
    p = Placement.owner_only(counts, ep_size=2)
    assert p.experts_on(0) == [0, 1] and p.expert_counts(0) == [0, 0] and p.receive_order(0).numel() == 0


def test_invalid_placements_raise_even_under_python_O():
    table = Placement.owner_only(COUNTS, ep_size=2).routing_table.clone()
    table[0, 0] = torch.tensor([2, 1])
    with pytest.raises(ValueError, match="no replica"):
        Placement(((0,), (0,), (1,), (1,)), table)
    with pytest.raises(ValueError, match="holding it first"):
        Placement(((1, 0), (0,), (1,), (1,)), table)
    with pytest.raises(ValueError, match="does not match"):
        Placement(((0,), (0,), (1,)), table)


def test_source_rows_equal_the_table_sums():
    """`source_rows` reads only the (expert, rank) pairs: the same sums as the whole table's."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        counts = torch.randint(0, 9, (5, 8), generator=gen)
        for p in (Placement.owner_only(counts, 4), Placement.shadowed(counts, 4, [1, 6], [0, 1, 2, 3, 3])):
            per_expert, per_rank = p.source_rows()
            assert torch.equal(per_expert, p.routing_table.sum(2)) and torch.equal(per_expert, counts)
            assert torch.equal(per_rank, p.routing_table.sum(1))
