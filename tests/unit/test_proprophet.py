"""Pro-Prophet's planner (techniques/proprophet/proprophet.py) and cost model (techniques/proprophet/proprophet_model.py):
water-filling, Replace_Inputs, Alg. 1 on worked examples (the paper's Fig. 6), the Placement it
becomes, and plan quality against a brute-force search over lightweight placements."""
import numpy as np
import pytest
import torch

from megatron_moe.techniques.proprophet.proprophet import (Loads, devices_for, greedy_search, lightweight_placement,
                                                   ratios_to_optimum, water_fill)
from megatron_moe.techniques.proprophet.proprophet_model import ProphetCostModel

# 1 s per row computed, 0.1 s per element moved, rows of 1 element, experts of 1 element: a
# replica costs little, so balancing pays (Eq. 6 by hand below)
CHEAP = ProphetCostModel(row_elements=1, params_per_expert=1.0, seconds_per_row=1.0, seconds_per_element=0.1,
                         fnec_seconds=0.0)


def test_water_fill_raises_the_lowest_first():
    assert water_fill([5, 1, 3], 0).tolist() == [0, 0, 0]
    assert water_fill([5, 1, 3], 2).tolist() == [0, 2, 0]  # 1 -> 3
    assert water_fill([5, 1, 3], 4).tolist() == [0, 3, 1]  # 1, 3 -> 4, 4
    assert water_fill([5, 1, 3], 5).tolist() == [0, 4, 1]  # 4.5 each: the odd row to the one that was lowest
    assert water_fill([5, 1, 3], 9).tolist() == [1, 5, 3]  # all at 6
    assert water_fill([2, 2], 3).tolist() == [2, 1]


def test_eq_1_to_8_by_hand():
    H, R = np.array([6, 2, 4]), np.array([3, 0, 1])
    # 4 A2A (max R 3 x 1 x 0.1) + 3 FEC (max H 6 x 1) + Trans + Agg (2 transfers x 1 x 0.1 / 3 devices)
    assert CHEAP.layer(H, R, 2) == pytest.approx(4 * 0.3 + 3 * 6 + 2 * (2 * 0.1 / 3))
    overlapped = ProphetCostModel(1, 1.0, 1.0, 0.1, fnec_seconds=0.0, overlap=True)
    assert overlapped.layer(H, R, 2) == pytest.approx(4 * 0.3 + 3 * 6)  # Eq. 8: Trans/Agg hidden by FEC
    slow = ProphetCostModel(1, 100.0, 1.0, 0.1, fnec_seconds=1.0, overlap=True)
    moved = 2 * 100 * 0.1 / 3  # 6.67 s: T_PTrans = 6.67 - 6 - 1 < 0, T_PAgg = 6.67 - 12 - 2 < 0
    assert slow.layer(H, R, 2) == pytest.approx(4 * 0.3 + 3 * 6)
    slower = ProphetCostModel(1, 1000.0, 1.0, 0.1, fnec_seconds=1.0, overlap=True)
    moved = 2 * 1000 * 0.1 / 3
    assert slower.layer(H, R, 2) == pytest.approx(4 * 0.3 + 3 * 6 + (moved - 7) + (moved - 14))


def test_replace_inputs_levels_the_loads_with_local_rows_first():
    T = np.array([[3, 0, 1], [4, 2, 0], [0, 1, 5]])  # [device, expert]: one expert per device
    loads = Loads(T)
    assert loads.H.tolist() == [7, 3, 6] and loads.R.tolist() == [4, 1, 1]
    # E0 (7 rows) also on device 1: levels (0, 3) -> shares (5, 2); device 0 keeps its 3 and
    # receives 2 of device 1's 4, device 1 keeps 2 of its own
    assert [v.tolist() for v in loads.replicate(0, (0, 1))] == [[3, 2], [2, 0]]
    assert loads.H.tolist() == [5, 5, 6] and loads.R.tolist() == [2, 1, 1]


def test_fig_6_worked_example():
    """The paper's Fig. 6: 5, 2, 2 inputs to E0, E1, E2 (one per device); device 2 routes nothing to
    E0, so E0 goes to device 1 only; devices 0 and 1 then share E0's rows."""
    T = np.array([[2, 1, 0], [3, 0, 1], [0, 1, 1]])
    loads = Loads(T)
    assert loads.H.tolist() == [5, 2, 2]
    assert devices_for(T, 0, 0, bottom_k=0) == (0, 1)  # device 2 has no rows of E0
    assert devices_for(T, 0, 0, bottom_k=1) == (0,)  # and with n = 1 device 1 (the fewest left) is cut
    chosen = greedy_search(T, CHEAP, alpha=0.0)
    assert chosen[0] == (0, (0, 1))
    placement = lightweight_placement(torch.tensor(T), [0, 1, 2], 3, chosen)
    assert placement.replicas[0] == (0, 1)
    # E0's 5 rows over levels (0, 2): shares (4, 1) -> device 1 keeps 1 of its 3, sends 2 to device 0
    assert placement.routing_table[:, 0].tolist() == [[2, 0, 0], [2, 1, 0], [0, 0, 0]]
    assert placement.tokens_per_ep_rank().tolist() == loads_after(T, chosen) == [4, 3, 2]


def loads_after(T, chosen):
    loads = Loads(T)
    for e, devices in chosen:
        loads.replicate(e, devices)
    return loads.H.tolist()


def test_rows_of_devices_without_the_expert_fill_the_lightest_device():
    """Two experts per device: E0 (device 0) is hot; bottom_k = 1 leaves device 1 (the fewest rows
    of E0) without a replica, so its rows go to whichever of E0's devices has room."""
    T = np.array([[4, 0, 1, 0, 0, 0], [2, 1, 0, 0, 1, 0], [6, 0, 0, 1, 0, 1]])
    assert devices_for(T, 0, 0, bottom_k=1) == (0, 2)  # device 1 has the fewest rows of E0
    placement = lightweight_placement(torch.tensor(T), [0, 1, 2], 3, [(0, (0, 2))])
    # owner-only loads: device 0 computes 12 + 1, device 1 1 + 1, device 2 1 + 1; E0's 12 rows over
    # levels (1, 2): shares (7, 5): device 0 keeps 4 and takes device 1's 2 and 1 of device 2's 6
    assert placement.routing_table[:, 0].tolist() == [[4, 0, 0], [2, 0, 0], [1, 0, 5]]
    assert placement.tokens_per_ep_rank().tolist() == [8, 2, 7]


def test_sources_on_the_same_device_and_the_placement_checks_itself():
    """Parm's S1/S2 send from every ep_esp rank: two sources per EP rank (esp = 2)."""
    counts = torch.tensor([[3, 1, 0, 0], [2, 0, 1, 0], [0, 0, 1, 1], [1, 0, 0, 2]])  # [S=4, E=4], ep = 2
    placement = lightweight_placement(counts, [0, 0, 1, 1], 2, [(0, (0, 1))])
    # E0's 6 rows over levels (1 = E1's row, 5): shares (5, 1) = what each device routes itself
    assert placement.routing_table[:, 0].tolist() == [[3, 0], [2, 0], [0, 0], [0, 1]]
    placement = lightweight_placement(counts, [0, 0, 1, 1], 2, [(3, (1, 0))])
    # E3's 3 rows (owner EP 1) over levels (EP 1: 2, EP 0: 7): all 3 to EP 1, EP 0 keeps none
    assert placement.routing_table[:, 3].tolist() == [[0, 0], [0, 0], [0, 1], [0, 2]]
    assert placement.routing_table.sum(2).tolist() == counts.tolist()  # every row dealt out once


def test_greedy_stops_when_balanced_and_when_moving_does_not_pay():
    balanced = np.array([[2, 2], [2, 2]])
    assert greedy_search(balanced, CHEAP, alpha=0.5) == []
    costly = ProphetCostModel(1, params_per_expert=1e6, seconds_per_row=1.0, seconds_per_element=0.1,
                              fnec_seconds=0.0)
    skewed = np.array([[8, 0], [8, 1]])
    assert greedy_search(skewed, costly, alpha=0.0) == []  # Trans + Agg of 1e6 elements never pays
    chosen = greedy_search(skewed, CHEAP, alpha=0.0)
    assert chosen == [(0, (0, 1))]  # then: E0's 16 rows over levels (0, 1): H = [9, 8]
    assert loads_after(skewed, chosen) == [9, 8]


def test_plan_quality_against_brute_force():
    """E <= 6, D <= 3, skewed random loads: Alg. 1's plan is within 10 % of the optimum over
    lightweight placements on every case (issue #10; measured: mean 1.003, worst 1.08, optimal in
    95 of 120) and never worse than no placement. The numbers are pinned so that a regression
    shows. (Taking the heaviest device's heaviest expert gave mean 1.006, worst 1.12; keeping every
    replica's own rows local instead of levelling the shares, mean 1.054, worst 1.80.)"""
    ratios = ratios_to_optimum(120, seed=0)
    mean = sum(ratios) / len(ratios)
    assert mean < 1.005 and sum(r < 1 + 1e-9 for r in ratios) >= 95, mean
    assert max(ratios) < 1.10, max(ratios)


def test_split_trans_takes_the_longest_prefix_that_fits_t_fec():
    """Alg. 2 line 7 (techniques/proprophet/cross_layer.py): SubTrans1 takes the replicated experts, in order, whose
    Eq. 4 times add up to at most the block before's T_FEC; SubTrans2 the rest. Here an expert
    moved to k replicas costs k x 1 element x 0.5 s / 2 devices = 0.25 k s (exact in binary)."""
    from megatron_moe.techniques.proprophet.cross_layer import split_trans

    model = ProphetCostModel(row_elements=1, params_per_expert=1.0, seconds_per_row=1.0, seconds_per_element=0.5,
                             fnec_seconds=0.0)
    selections = [(0, (0, 1)), (2, (1, 0, 3)), (5, (2, 1)), (7, (3, 0))]  # 1, 2, 1, 1 replicas
    cumulative = [0.25, 0.75, 1.0, 1.25]
    assert split_trans(selections, model, 2, 0.0) == 0  # nothing fits: all in SubTrans2
    for count, spent in enumerate(cumulative, start=1):
        assert split_trans(selections, model, 2, spent) == count  # a prefix that fits exactly is taken
        assert split_trans(selections, model, 2, spent - 1e-9) == count - 1
    assert split_trans(selections, model, 2, 10.0) == 4  # everything fits: SubTrans2 moves nothing
    assert split_trans(selections, model, 4, 0.5) == 3  # Eq. 4 divides by the devices: 0.125 k s
    assert split_trans([], model, 2, 1.0) == 0
    # the cut is a prefix: a later, cheaper expert does not jump ahead of an expensive one
    assert split_trans([(1, (0, 1, 2, 3)), (4, (1, 0))], model, 2, 0.5) == 0


def test_local_rows_keep_every_replicas_own_rows():
    """`moe.proprophet.rows: local` (§4.2): a device with a replica of e computes exactly its own
    sources' rows of e and receives none; the owner computes the rest. Balanced rows level loads."""
    from megatron_moe.techniques.proprophet.proprophet import lightweight_placement
    T = np.array([[2, 30, 1, 1, 1, 1], [1, 9, 4, 4, 1, 1], [3, 12, 2, 2, 1, 1]])  # expert 1: hot, on device 0
    local, balanced = Loads(T, "local"), Loads(T)
    move = local.moved(1, np.array([0, 1, 2]))
    assert move.share.tolist() == [30, 9, 12] and move.received.tolist() == [0, 0, 0]
    assert balanced.moved(1, np.array([0, 1, 2])).share.tolist() != [30, 9, 12]
    counts = torch.tensor([[1, 20, 1, 0, 1, 1], [1, 10, 0, 1, 0, 0], [1, 9, 4, 4, 1, 1], [3, 12, 2, 2, 1, 1]])
    placement = lightweight_placement(counts, [0, 0, 1, 2], 3, [(1, (0, 2))], rows="local")
    table = placement.routing_table  # [S, E, ep]
    assert table[:, 1].tolist() == [[20, 0, 0], [10, 0, 0], [9, 0, 0], [0, 0, 12]]  # device 1 has no replica
    assert (table.sum(2) == counts).all()
