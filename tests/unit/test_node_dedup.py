"""The proxy rule of the node-deduplicated dispatch (techniques/node_dedup/node_dedup.py): which
member of the `ep` group receives a source's rows on each node, from the members' global ranks
and `ranks_per_node`; and hop 2's splits per `ep` member as splits over `ep_node` (no process group)."""
from types import SimpleNamespace

import pytest

from megatron_moe.distributed.group import Group
from megatron_moe.distributed.parallel_state import ParallelState, RankLayout
from megatron_moe.techniques.node_dedup.node_dedup import NodeDedup, NodeProxies


def _proxies(ranks, ranks_per_node):
    return NodeProxies.of(Group("ep", ranks, 0, None, ranks_per_node))


def test_same_local_index_on_the_other_nodes():
    p = _proxies([0, 1, 2, 3], 2)  # expert 4 on 2 nodes
    assert p.node == (0, 0, 1, 1) and p.members == ((0, 1), (2, 3))
    assert [[p.proxy(s, n) for n in range(2)] for s in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def test_nodes_are_numbered_from_the_groups_first_and_strided_members():
    # expert 2 x expert_shard 2 on the second half of 8 ranks: esp rank 1's ep group {5, 7}, one per node
    p = _proxies([5, 7], 2)
    assert p.node == (0, 1) and [[p.proxy(s, n) for n in range(2)] for s in range(2)] == [[0, 1], [0, 1]]
    p = _proxies([1, 3, 5, 7], 4)  # two ep members per node of 4 ranks
    assert p.node == (0, 0, 1, 1) and p.proxy(1, 1) == 3 and p.proxy(2, 0) == 0


def test_uneven_nodes_wrap_the_local_index():
    p = _proxies([0, 1, 2], 2)  # nodes {0, 1} and {2}
    assert p.members == ((0, 1), (2,))
    assert [p.proxy(s, 1) for s in range(3)] == [2, 2, 2] and [p.proxy(s, 0) for s in range(3)] == [0, 1, 0]


def test_one_node_without_ranks_per_node():
    p = _proxies([0, 1, 2, 3], None)
    assert p.node == (0, 0, 0, 0) and all(p.proxy(s, 0) == s for s in range(4))


def _dispatch(layout: RankLayout, rank: int) -> NodeDedup:
    return NodeDedup(SimpleNamespace(state=ParallelState.build(layout, rank)))


def test_hop2_splits_are_the_ep_node_members_slice():
    """Expert 4 on 2 nodes: ep_node {0,1} {2,3}; a split over ep [4] becomes one over the node's 2
    members, the same counts in the same order; a count for a member of another node is refused."""
    layout = RankLayout(world_size=4, expert=4, ranks_per_node=2)
    for rank in range(4):
        d = _dispatch(layout, rank)
        node = rank // 2
        assert d.ep_node.ranks == [2 * node, 2 * node + 1] and d.ep_node.rank == rank % 2
        per_ep = [0, 0, 0, 0]
        per_ep[2 * node], per_ep[2 * node + 1] = 5, 7
        assert d._in_node(per_ep) == [5, 7]
        per_ep[2 * (1 - node)] = 1
        with pytest.raises(AssertionError):
            d._in_node(per_ep)


@pytest.mark.parametrize("kwargs", [dict(world_size=4, expert=4), dict(world_size=8, expert=4, ranks_per_node=8),
                                    dict(world_size=8, expert=2, expert_shard=2, ranks_per_node=2),
                                    dict(world_size=12, expert=4, ranks_per_node=3),
                                    dict(world_size=8, expert=4, expert_shard=2, ranks_per_node=4)])
def test_ep_node_is_the_proxies_node(kwargs):
    """For every rank, ep_node's members are its ep group's members on its node (NodeProxies'
    node of the rank): one node (ep_node = ep: the identity split), one EP rank per node (alone:
    hop 2 is a no-op), uneven nodes, strided ep groups."""
    layout = RankLayout(**kwargs)
    for rank in range(layout.world_size):
        d = _dispatch(layout, rank)
        ep = d.schedule.state.ep
        mine = [q for q in range(ep.size) if d.proxies.node[q] == d.proxies.node[ep.rank]]
        assert d.ep_node.ranks == [ep.ranks[q] for q in mine], (rank, ep.ranks)
        assert d.ep_node.ranks[d.ep_node.rank] == rank
        assert d._in_node([q + 1 if q in mine else 0 for q in range(ep.size)]) == [q + 1 for q in mine]
        if kwargs.get("ranks_per_node") in (None, 8):
            assert d.ep_node.ranks == ep.ranks
