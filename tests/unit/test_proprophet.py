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
    lightweight placements on every case with balanced rows (issue #10; measured: mean 1.003, worst
    1.08, optimal in 95 of 120) and never worse than no placement; with the paper's local rows
    (each against the optimum with local rows) mean 1.025, worst 1.316, optimal in 70. The numbers
    are pinned so that a regression shows. (Taking the heaviest device's heaviest expert gave mean
    1.006, worst 1.12 with balanced rows.)"""
    for rows, mean_below, worst_below, optimal in [("balanced", 1.005, 1.10, 95), ("local", 1.03, 1.35, 70)]:
        ratios = ratios_to_optimum(120, seed=0, rows=rows)
        mean = sum(ratios) / len(ratios)
        assert mean < mean_below and sum(r < 1 + 1e-9 for r in ratios) >= optimal, (rows, mean)
        assert max(ratios) < worst_below, (rows, max(ratios))


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
    """`moe.proprophet.rows: local` (the paper's, §IV-A, Fig. 6b): a device with a replica of e
    computes exactly its own sources' rows of e and receives none; the owner computes the rest.
    Balanced rows level loads."""
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


def test_the_default_rows_are_the_papers_local_rows():
    """Issue #42 item 7: `moe.proprophet.rows` defaults to `local`, the paper's (§IV-A, Fig. 6b);
    the balancer built from the default config plans it (balanced, ours, is opt-in)."""
    from megatron_moe.config.schema import Config
    from megatron_moe.distributed.parallel_state import ParallelState, RankLayout
    from megatron_moe.techniques.proprophet.proprophet import ROWS, ProProphet

    cfg = Config()
    assert cfg.moe.proprophet.rows == ROWS[0] == "local"
    cfg.moe.num_experts, cfg.moe.proprophet.min_replicas = 6, 1
    cfg.perf.hardware_profile = "configs/hardware/cpu_gloo_2proc.yaml"
    balancer = ProProphet(cfg, ParallelState.build(RankLayout(world_size=3, expert=3), rank=0))
    counts = torch.tensor([[1, 20, 1, 0, 1, 1], [1, 10, 0, 1, 0, 0], [1, 9, 4, 4, 1, 1], [3, 12, 2, 2, 1, 1]])
    sources = [0, 0, 1, 2]
    placement = balancer.plan(counts, sources)
    chosen = balancer.search(counts, sources)
    assert chosen and placement.replicas == lightweight_placement(counts, sources, 3, chosen, rows="local").replicas
    local, balanced = (lightweight_placement(counts, sources, 3, chosen, rows=rows).routing_table.tolist()
                       for rows in ("local", "balanced"))
    assert placement.routing_table.tolist() == local != balanced
    # Fig. 6b: E0 (5 inputs, 2 on Dev. 0, 3 on Dev. 1) on devices 0 and 1, each computing its own inputs
    T = np.array([[2, 1, 0], [3, 0, 1], [0, 1, 1]])
    assert Loads(T, "local").moved(0, np.array([0, 1])).share.tolist() == [2, 3]


def test_split_agg_takes_the_longest_prefix_that_fits_t_bnec():
    """Alg. 2 lines 5, 12 (techniques/proprophet/cross_layer.py): SubAgg1 takes the replicated experts, in
    order, whose Eq. 5 times add up to at most T_BNEC = 2 T_FNEC (§V-B: static); SubAgg2 the rest.
    An expert sent to k devices costs k x 1 element x 0.5 s / 2 devices = 0.25 k s."""
    from dataclasses import replace

    from megatron_moe.techniques.proprophet.cross_layer import split_agg

    model = ProphetCostModel(row_elements=1, params_per_expert=1.0, seconds_per_row=1.0, seconds_per_element=0.5,
                             fnec_seconds=0.0)
    selections = [(0, (0, 1)), (2, (1, 0, 3)), (5, (2, 1))]  # cumulative 0.25, 0.75, 1.0 s
    for fnec, count in [(0.0, 0), (0.125, 1), (0.375 - 1e-9, 1), (0.375, 2), (0.5, 3)]:
        assert split_agg(selections, replace(model, fnec_seconds=fnec), 2) == count, fnec
    assert split_agg([], model, 2) == 0


def test_the_replica_balancers_ask_for_a_side_channel_of_ep():
    """SIDE_CHANNELS (distributed/parallel_state.py): Trans / Agg (moe/replicas.py) of Pro-Prophet,
    with `overlap` or without, and of FasterMoE need one, as FlexMoE's best-effort moves do; the
    trainer builds it (training/entry.py)."""
    from megatron_moe.config.schema import Config
    from megatron_moe.distributed.parallel_state import side_channels

    cfg = Config()
    for balancer, overlap in [("proprophet", False), ("proprophet", True), ("fastermoe", False)]:
        cfg.moe.balancer, cfg.moe.proprophet.overlap = balancer, overlap
        assert side_channels(cfg) == ["ep"], (balancer, overlap)
    cfg.moe.balancer = "none"
    assert side_channels(cfg) == []


# the paper's sections as printed (I. Introduction ... VIII. Conclusion; A-C subsections)
PAPER_SECTIONS = {"I", "II", "II-A", "II-B", "III", "IV", "IV-A", "IV-B", "IV-C", "V", "V-A", "V-B", "V-C", "VI",
                  "VI-A", "VI-B", "VI-C", "VII", "VIII"}


def test_pro_prophet_section_references_exist_in_the_paper():
    """Issue #42 item 7: the docs cited a "§4.2" that the paper does not have. Every § reference
    in Pro-Prophet's modules, its docs/balancers.md section, its docs/configs.md rows and its
    reproduction notes names a section of the paper (a range like §III-V: both ends)."""
    import glob
    import re

    def section(text: str, start: str, end: str) -> str:
        return text[text.index(start):text.index(end, text.index(start))]

    balancers = open("docs/balancers.md").read()
    sources = {path: open(path).read() for path in glob.glob("megatron_moe/techniques/proprophet/*.py")}
    sources["docs/balancers.md"] = (section(balancers, "## Pro-Prophet", "\n## ")
                                    + section(balancers, "### Pro-Prophet", "\n### "))
    sources["docs/configs.md"] = "".join(line for line in open("docs/configs.md") if "moe.proprophet." in line)
    notes = open("tools/reproduce_notes.py").read()
    sources["tools/reproduce_notes.py"] = section(notes, '"proprophet": """', '""",')
    reference = re.compile(r"§\s*([0-9A-Z]+(?:[.-][0-9A-Z]+)*)")
    cited = {(path, ref) for path, text in sources.items() for ref in reference.findall(text)}
    assert len(cited) >= 10, cited
    bad = [(path, ref) for path, ref in cited
           if not all(end in PAPER_SECTIONS for end in ([ref] if ref in PAPER_SECTIONS else ref.split("-")))]
    assert not bad, bad
