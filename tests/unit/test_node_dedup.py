"""The proxy rule of the node-deduplicated dispatch (techniques/node_dedup/node_dedup.py): which
member of the `ep` group receives a source's rows on each node, from the members' global ranks
and `ranks_per_node` (no process group)."""
from megatron_moe.distributed.group import Group
from megatron_moe.techniques.node_dedup.node_dedup import NodeProxies


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
