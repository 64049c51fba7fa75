"""Rank layout of ParallelState for several (world, tp, ep, esp), without spawning processes."""
import pytest

from megatron_moe.distributed.parallel_state import GROUP_NAMES, RankLayout


def test_worked_example_world8_tp2_ep2_esp2():
    lay = RankLayout(world_size=8, tensor=2, expert=2, expert_shard=2)
    assert lay.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert lay.groups("esp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups("ep_esp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lay.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.groups("pp") == [[r] for r in range(8)]
    assert lay.data_parallel == 4 and lay.expert_data_parallel == 2


def test_esp_spans_two_tp_groups():
    lay = RankLayout(world_size=8, tensor=2, expert=2, expert_shard=4)
    assert lay.groups("esp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lay.groups("ep") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.groups("edp") == [[r] for r in range(8)]
    assert lay.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_esp_inside_tp_group():
    lay = RankLayout(world_size=8, tensor=4, expert=2, expert_shard=2)
    assert lay.groups("tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lay.groups("esp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_expert_only_with_data_parallel():
    lay = RankLayout(world_size=4, expert=2)
    assert lay.groups("ep") == [[0, 1], [2, 3]]
    assert lay.groups("edp") == [[0, 2], [1, 3]]
    assert lay.groups("dp") == [[0, 1, 2, 3]]
    assert lay.groups("esp") == [[r] for r in range(4)]


@pytest.mark.parametrize("world,tp,ep,esp", [
    (1, 1, 1, 1), (2, 2, 1, 1), (2, 1, 2, 1), (4, 1, 2, 2), (8, 2, 2, 2), (8, 1, 4, 2),
    (8, 2, 4, 1), (8, 4, 2, 1), (8, 2, 2, 4), (8, 4, 2, 2), (16, 2, 4, 2), (16, 4, 2, 2),
])
def test_groups_partition_world_and_coords_agree(world, tp, ep, esp):
    lay = RankLayout(world_size=world, tensor=tp, expert=ep, expert_shard=esp)
    expected_size = {"tp": tp, "dp": world // tp, "pp": 1, "ep": ep, "ep_node": ep, "esp": esp, "ep_esp": ep * esp,
                     "edp": world // (ep * esp), "embedding": 1, "world": world}
    for name in GROUP_NAMES:
        groups = lay.groups(name)
        assert sorted(r for g in groups for r in g) == list(range(world)), name
        assert all(len(g) == expected_size[name] for g in groups), name
        for g in groups:
            # a rank's coordinate in the group equals its position in the rank list
            assert [lay.coords(r)[name] for r in g] == list(range(len(g))), (name, g)
    assert lay.groups("ep_node") == lay.groups("ep")  # one node: an ep group is its node's members
    # ep_esp holds one copy of every expert: (ep, esp) pairs are all distinct in it
    for g in lay.groups("ep_esp"):
        assert len({(lay.coords(r)["ep"], lay.coords(r)["esp"]) for r in g}) == ep * esp
    # tp is the fastest dense index; esp the fastest expert index
    assert lay.coords(1)["tp"] == (1 if tp > 1 else 0)
    assert lay.coords(1)["esp"] == (1 if esp > 1 else 0)


def test_pipeline_stages_prepend_the_stage():
    """rank = pp_rank * stage_size + local; every other group lies inside one stage; the embedding
    group pairs the first and the last stage's rank of one local rank (middle stages: alone)."""
    lay = RankLayout(world_size=8, tensor=2, pipeline=2, expert=2)
    assert lay.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.groups("embedding") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.groups("edp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.data_parallel == 2 and lay.stage_size == 4
    lay = RankLayout(world_size=8, tensor=2, pipeline=4)
    assert lay.groups("pp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert lay.groups("embedding") == [[0, 6], [1, 7], [2], [3], [4], [5]]
    for name in GROUP_NAMES:
        for g in lay.groups(name):
            assert [lay.coords(r)[name] for r in g] == list(range(len(g))), (name, g)


def test_ep_node_is_an_ep_groups_members_on_one_node():
    """ep_node: the ep group cut at node boundaries (blocks of ranks_per_node global ranks), in
    member order, ordered by (stage, edp, esp, node); a rank's coordinate is its index in it."""
    lay = RankLayout(world_size=8, expert=4, ranks_per_node=2)
    assert lay.groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lay.groups("ep_node") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [lay.coords(r)["ep_node"] for r in range(8)] == [0, 1] * 4
    # the worked example on nodes of 2: every ep group {0,2} {1,3} ... spans two nodes, one member each
    lay = RankLayout(world_size=8, tensor=2, expert=2, expert_shard=2, ranks_per_node=2)
    assert lay.groups("ep_node") == [[0], [2], [1], [3], [4], [6], [5], [7]]
    # on nodes of 4 it is ep
    lay = RankLayout(world_size=8, tensor=2, expert=2, expert_shard=2, ranks_per_node=4)
    assert lay.groups("ep_node") == lay.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # expert 4 x expert_shard 2 on nodes of 4: ep {0,2,4,6} -> {0,2} {4,6}
    lay = RankLayout(world_size=8, expert=4, expert_shard=2, ranks_per_node=4)
    assert lay.groups("ep_node") == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert [lay.coords(r)["ep_node"] for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


@pytest.mark.parametrize("kwargs,per_node", [(dict(world_size=12, expert=4), 3), (dict(world_size=12, expert=6), 4),
                                             (dict(world_size=24, pipeline=3, expert=2, expert_shard=2), 3),
                                             (dict(world_size=16, tensor=2, pipeline=2, expert=4), 2)])
def test_ep_node_uneven_nodes_partition_every_ep_group(kwargs, per_node):
    """Node boundaries that cut ep groups unevenly ({0,1,2} {3} {4,5} ... for expert 4 on nodes of
    3): every ep group is the concatenation of its ep_node groups, each on one node, every rank's
    coordinate its index there."""
    lay = RankLayout(**kwargs, ranks_per_node=per_node)
    pieces = lay.groups("ep_node")
    assert sorted(r for g in pieces for r in g) == list(range(lay.world_size))
    for g in pieces:
        assert len({r // per_node for r in g}) == 1, g
        assert [lay.coords(r)["ep_node"] for r in g] == list(range(len(g))), g
    for g in lay.groups("ep"):
        assert [r for p in pieces if p[0] in g for r in p] == g, g
        assert len([p for p in pieces if p[0] in g]) == len({r // per_node for r in g}), g
    if kwargs == dict(world_size=12, expert=4):
        assert pieces == [[0, 1, 2], [3], [4, 5], [6, 7], [8], [9, 10, 11]]


@pytest.mark.parametrize("kwargs,side", [
    (dict(world_size=8, expert=4), ["ep"]),  # tp = esp = pp = embedding = 1: those kinds create none
    (dict(world_size=8, tensor=2, expert=2, expert_shard=2, ranks_per_node=2), ["ep", "esp"]),  # ep_node all 1
    (dict(world_size=6, expert=3, ranks_per_node=4), []),  # ep_node {0,1,2} {3} {4,5}: only the {3} skipped
])
def test_build_creates_no_process_group_of_one_rank(monkeypatch, kwargs, side):
    """Issue #44 item 7: `new_group` is called for every group of more than one rank, and for no
    group of one (side channels included), in the same order on every rank (the calls depend on the
    layout only); each rank's groups of one carry no handle nor device."""
    from megatron_moe.distributed import collectives
    from megatron_moe.distributed.parallel_state import ParallelState

    layout = RankLayout(**kwargs)
    calls = {}
    for rank in range(layout.world_size):
        made = calls[rank] = []

        def fake(ranks, made=made):
            made.append(list(ranks))
            return f"pg{len(made)}"

        monkeypatch.setattr(collectives, "is_initialized", lambda: True)
        monkeypatch.setattr(collectives, "new_group", fake)
        monkeypatch.setattr(collectives, "backend_device", lambda handle: "cpu")
        monkeypatch.setattr("megatron_moe.distributed.parallel_state.warm_up_p2p", lambda group, side=False: None)
        state = ParallelState.build(layout, rank, side_channels=side)
        for name, group in state.groups.items():
            alone = group.size == 1
            assert (group.handle is None) == alone and (group.device is None) == alone, (name, rank)
            assert (group.side_handle is None) == (alone or name not in side), (name, rank)
    wanted = [g for name in GROUP_NAMES for g in layout.groups(name) if len(g) > 1]
    wanted += [g for name in sorted(side) for g in layout.groups(name) if len(g) > 1]
    assert all(made == wanted for made in calls.values())
