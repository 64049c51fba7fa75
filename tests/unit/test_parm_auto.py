"""Parm's automatic choice (Alg. 1, Eq. 12-14; worked examples computed by hand, the readings of
Alg. 1 line 5 counted in docs/parm.md), alpha-beta fits, hardware profiles, config rules, and
S1/S2/SAA/auto on one process against the reference."""
import itertools
from pathlib import Path

import pytest
import torch

from megatron_moe.config import ConfigError, load_config, validate_config
from megatron_moe.distributed.parallel_state import ParallelState, RankLayout
from megatron_moe.perf.alpha_beta import AlphaBeta, fit_alpha_beta
from megatron_moe.perf.hardware import HardwareProfile, load_profile, save_profile
from megatron_moe.techniques.parm.parm_model import (capacity_assignments, choose_schedule, dispatched_assignments,
                                          schedule_times)
from tests.distributed.moe_cases import CASES, case_data, check_against_reference, run_layer
# GRID: Parm Table III (P only sizes the groups the profile was measured on; E cancels in E T = k f B L)
from tools.parm_alg1_readings import (TABLE3_GRID as GRID, TESTBEDS, count_s2_per_profile, markdown_table,
                                      t_d2_saa)

ROOT = Path(__file__).resolve().parents[2]


def _closed_form(p: HardwareProfile, n_mp, n_esp, batch, seq, hidden, f, k, saa):
    """Eq. 13 and Alg. 1 line 5 (SAA) or Eq. 7's sequential bound (AAS) written out, with
    E T M N_ESP / N_MP elements per rank in each EP&ESP-AlltoAll: (t_D1, t_D2)."""
    (ag_a, ag_b), (a2a_a, a2a_b), (o_a, o_b) = [(x.alpha, x.beta) for x in (p.mp_allgather, p.ep_esp_alltoall, p.saa)]
    etm = k * f * batch * seq * hidden
    t_d1 = 2 * (a2a_a + a2a_b * etm * n_esp / n_mp) + ag_a + ag_b * batch * seq * hidden
    if saa:
        return t_d1, a2a_a + a2a_b * etm * n_esp / n_mp + o_a + o_b * etm * n_esp / n_mp
    return t_d1, 2 * (a2a_a + a2a_b * etm * n_esp / n_mp) + ag_a + ag_b * etm


@pytest.mark.parametrize("path", TESTBEDS, ids=["testbed_a", "testbed_b"])
@pytest.mark.parametrize("saa", [True, False], ids=["saa", "aas"])
def test_alg1_matches_closed_form_on_table3_grid(path, saa):
    profile = load_profile(str(path))
    picks = set()
    for n_mp, n_esp, batch, seq, hidden, f, k in itertools.product(*GRID.values()):
        t_d1, t_d2 = _closed_form(profile, n_mp, n_esp, batch, seq, hidden, f, k, saa)
        assignments = capacity_assignments(batch * seq, k, f)
        times = schedule_times(profile, batch * seq, hidden, assignments, n_mp, n_esp, saa)
        assert times == pytest.approx((t_d1, t_d2))
        pick = choose_schedule(profile, batch * seq, hidden, assignments, n_mp, n_esp, saa)
        assert pick == ("s1" if n_mp == 1 or t_d1 <= t_d2 else "s2"), (n_mp, n_esp, batch, seq, hidden, f, k)
        picks.add(pick)
    assert picks == ({"s1", "s2"} if saa else {"s1"})  # AAS: S2 only if E T < B L (here k f >= 1.2)
    # §IV-B: with N_ESP = 1, S2 wins as T -> 0 and S1 as T -> infinity
    assert choose_schedule(profile, 4096, 1024, 1, n_mp=2, n_esp=1, saa=saa) == "s2"
    assert choose_schedule(profile, 4096, 1024, 1e9, n_mp=2, n_esp=1, saa=saa) == "s1"


# Alg. 1 worked by hand (not by the code's own formula): the profiles' numbers put into Alg. 1
# lines 1-5 / Eq. 12-14, every product written out. Units: elements, seconds. Profiles:
#   testbed A: AG_MP alpha 6.64e-4 beta 5.38e-10, A2A alpha 6.64e-4 beta 5.38e-10, Overlap alpha 1.3137e-3 beta 1.0644e-9
#   testbed B: AG_MP alpha 1.09e-4 beta 7.14e-10, A2A alpha 1.09e-4 beta 1.12e-9,  Overlap alpha 2.1559e-4 beta 1.8137e-9
# Line 2 without its typo M: E T = k f B L. Line 3: y = E T M N_ESP; the all-to-all's input x = y / N_MP.
WORKED = {
    # 1. testbed A, N_MP 2, N_ESP 2, B 4, L 512, M 1024, k 2, f 1.2, SAA
    #    B L = 2048, B L M = 2 097 152; E T = 2 * 1.2 * 2048 = 4915.2; E T M = 5 033 164.8
    #    y = 5 033 164.8 * 2 = 10 066 329.6; x = y / 2 = 5 033 164.8
    #    A2A(x)   = 6.64e-4 + 5.38e-10 * 5 033 164.8  = 6.64e-4 + 2.7078426624e-3 = 3.3718426624e-3
    #    AG(BLM)  = 6.64e-4 + 5.38e-10 * 2 097 152    = 6.64e-4 + 1.128267776e-3  = 1.792267776e-3
    #    t_D1     = 2 * 3.3718426624e-3 + 1.792267776e-3                         = 8.5359531008e-3
    #    Overlap(x) = 1.3137e-3 + 1.0644e-9 * 5 033 164.8 = 1.3137e-3 + 5.35730061312e-3 = 6.67100061312e-3
    #    t_D2     = 3.3718426624e-3 + 6.67100061312e-3                            = 1.004284327552e-2
    #    t_D1 <= t_D2: S1 (k f N_ESP / N_MP = 2.4 >= 1)
    "a_mp2_esp2_top2": ("a", dict(n_mp=2, n_esp=2, batch=4, seq=512, hidden=1024, k=2, f=1.2), True,
                        (8.5359531008e-3, 1.004284327552e-2), "s1"),
    # 2. testbed A, N_MP 2, N_ESP 1, B 4, L 512, M 1024, k 1, f 1.2, SAA
    #    B L M = 2 097 152; E T = 1 * 1.2 * 2048 = 2457.6; E T M = 2 516 582.4; y = 2 516 582.4; x = 1 258 291.2
    #    A2A(x)   = 6.64e-4 + 5.38e-10 * 1 258 291.2  = 6.64e-4 + 6.769606656e-4  = 1.3409606656e-3
    #    t_D1     = 2 * 1.3409606656e-3 + 1.792267776e-3                         = 4.4741891072e-3
    #    Overlap(x) = 1.3137e-3 + 1.0644e-9 * 1 258 291.2 = 1.3137e-3 + 1.33932515328e-3 = 2.65302515328e-3
    #    t_D2     = 1.3409606656e-3 + 2.65302515328e-3                            = 3.99398581888e-3
    #    t_D1 > t_D2: S2 (top-1 without ESP: k f N_ESP / N_MP = 0.6 < 1)
    "a_mp2_esp1_top1": ("a", dict(n_mp=2, n_esp=1, batch=4, seq=512, hidden=1024, k=1, f=1.2), True,
                        (4.4741891072e-3, 3.99398581888e-3), "s2"),
    # 3. testbed B, N_MP 4, N_ESP 2, B 2, L 1024, M 2048, k 1, f 1.2, SAA
    #    B L = 2048, B L M = 4 194 304; E T = 2457.6; E T M = 5 033 164.8; y = 10 066 329.6; x = 2 516 582.4
    #    A2A(x)   = 1.09e-4 + 1.12e-9 * 2 516 582.4   = 1.09e-4 + 2.818572288e-3  = 2.927572288e-3
    #    AG(BLM)  = 1.09e-4 + 7.14e-10 * 4 194 304    = 1.09e-4 + 2.994733056e-3  = 3.103733056e-3
    #    t_D1     = 2 * 2.927572288e-3 + 3.103733056e-3                          = 8.958877632e-3
    #    Overlap(x) = 2.1559e-4 + 1.8137e-9 * 2 516 582.4 = 2.1559e-4 + 4.56432549888e-3 = 4.77991549888e-3
    #    t_D2     = 2.927572288e-3 + 4.77991549888e-3                             = 7.70748778688e-3
    #    t_D1 > t_D2: S2 (k f N_ESP / N_MP = 0.6)
    "b_mp4_esp2_top1": ("b", dict(n_mp=4, n_esp=2, batch=2, seq=1024, hidden=2048, k=1, f=1.2), True,
                        (8.958877632e-3, 7.70748778688e-3), "s2"),
    # 4. case 3 with AAS (moe.saa false): t_D2 = 2 A2A(x) + AG_MP(E T M) (Eq. 7's right-hand side)
    #    AG(ETM)  = 1.09e-4 + 7.14e-10 * 5 033 164.8  = 1.09e-4 + 3.5936796672e-3 = 3.7026796672e-3
    #    t_D2     = 2 * 2.927572288e-3 + 3.7026796672e-3                         = 9.5578242432e-3
    #    t_D1 = 8.958877632e-3 <= t_D2: S1 (AAS: S2 only when E T < B L; here 2457.6 > 2048)
    "b_mp4_esp2_top1_aas": ("b", dict(n_mp=4, n_esp=2, batch=2, seq=1024, hidden=2048, k=1, f=1.2), False,
                            (8.958877632e-3, 9.5578242432e-3), "s1"),
    # 5. case 4 with capacity factor 0.8 (drops): E T = 0.8 * 2048 = 1638.4 < B L; E T M = 3 355 443.2;
    #    x = 3 355 443.2 * 2 / 4 = 1 677 721.6
    #    A2A(x)   = 1.09e-4 + 1.12e-9 * 1 677 721.6   = 1.09e-4 + 1.879048192e-3  = 1.988048192e-3
    #    t_D1     = 2 * 1.988048192e-3 + 3.103733056e-3                          = 7.07982944e-3
    #    AG(ETM)  = 1.09e-4 + 7.14e-10 * 3 355 443.2  = 1.09e-4 + 2.3957864448e-3 = 2.5047864448e-3
    #    t_D2     = 2 * 1.988048192e-3 + 2.5047864448e-3                         = 6.4808828288e-3
    #    t_D1 > t_D2: S2
    "b_mp4_esp2_top1_aas_drops": ("b", dict(n_mp=4, n_esp=2, batch=2, seq=1024, hidden=2048, k=1, f=0.8), False,
                                  (7.07982944e-3, 6.4808828288e-3), "s2"),
}


@pytest.mark.parametrize("case", list(WORKED))
def test_alg1_worked_examples_by_hand(case):
    testbed, c, saa, times, pick = WORKED[case]
    profile = load_profile(str(TESTBEDS["ab".index(testbed)]))
    tokens, assignments = c["batch"] * c["seq"], capacity_assignments(c["batch"] * c["seq"], c["k"], c["f"])
    args = (profile, tokens, c["hidden"], assignments, c["n_mp"], c["n_esp"], saa)
    assert schedule_times(*args) == pytest.approx(times, rel=1e-9)
    assert choose_schedule(*args) == pick


def test_alg1_readings_by_hand_and_their_counts_in_the_docs():
    """tools/parm_alg1_readings.py: the three readings of Alg. 1 line 5 / Eq. 14 (S2 + SAA)."""
    a = load_profile(str(TESTBEDS[0]))
    # worked example 2 (testbed A, N_MP 2, N_ESP 1, k 1, f 1.2): y = 2 516 582.4, x = 1 258 291.2, t_D1 = 4.4741891072e-3
    # R1 = A2A(x) + Overlap(x) = 3.99398581888e-3 (above): S2
    # R2 = A2A(y / 2) + 1.3137e-3 + 1.0644e-9 * 2 516 582.4 = 1.3409606656e-3 + 1.3137e-3 + 2.67865030656e-3
    #    = 5.33331097216e-3: S1
    # R3 = R1 + AG(E T M) = 3.99398581888e-3 + 6.64e-4 + 5.38e-10 * 2 516 582.4
    #    = 3.99398581888e-3 + 2.0179213312e-3 = 6.01190715008e-3: S1
    args = (a, 2048, 1024, 2457.6, 2, 1)
    assert [t_d2_saa(r, *args) for r in ("R1", "R2", "R3")] == pytest.approx(
        [3.99398581888e-3, 5.33331097216e-3, 6.01190715008e-3], rel=1e-9)
    results = count_s2_per_profile(TESTBEDS)
    # the counts docs/parm.md reports ("Which reading of Alg. 1 the code follows"), out of 972 = 3^5 * 2^2
    expected = {"R1": {"total": 135, "n_mp=1": 0, "n_mp=2": 27, "n_mp=4": 108},
                "R2": {"total": 0, "n_mp=1": 0, "n_mp=2": 0, "n_mp=4": 0},
                "R3": {"total": 0, "n_mp=1": 0, "n_mp=2": 0, "n_mp=4": 0}}
    assert results == {"parm_testbed_a": expected, "parm_testbed_b": expected}
    assert markdown_table(results) in (ROOT / "docs/parm.md").read_text()


def test_online_assignments_follow_the_busiest_ep_rank():
    assert capacity_assignments(8, 2, 1.0) == 16
    # rows per EP rank of one ep_esp group (placement.tokens_per_ep_rank()) -> E T of a micro-batch:
    # tensor 2, expert 2: the group is one micro-batch (16 assignments) split over its 2 TP ranks
    assert dispatched_assignments(torch.tensor([8, 8]), n_mp=2, n_esp=1) == 16  # balanced: k B L
    assert dispatched_assignments(torch.tensor([10, 6]), n_mp=2, n_esp=1) == 20  # EP rank 0 bottleneck
    # expert 2, expert_shard 2, tensor 1: four micro-batches of 16 assignments in the group
    assert dispatched_assignments(torch.tensor([32, 32]), n_mp=1, n_esp=2) == 16
    # tensor 4, expert 2: the group holds half of one micro-batch
    assert dispatched_assignments(torch.tensor([4, 4]), n_mp=4, n_esp=1) == 16
    # threshold profile: t_D1 = B L M, t_D2 = 0.5 (E T) M N_ESP / N_MP -> S1 iff E T >= 32
    profile = HardwareProfile("t", AlphaBeta(0, 1), AlphaBeta(0, 0), AlphaBeta(0, 0.5))
    assert choose_schedule(profile, 8, 4, 16, n_mp=2, n_esp=1) == "s2"
    assert choose_schedule(profile, 8, 4, 32, n_mp=2, n_esp=1) == "s1"
    # AAS: t_D2 = AG_MP(E T M) against t_D1's AG_MP(B L M): S2 iff fewer assignments than tokens (drops)
    assert choose_schedule(profile, 8, 4, 7, n_mp=2, n_esp=1, saa=False) == "s2"
    assert choose_schedule(profile, 8, 4, 8, n_mp=2, n_esp=1, saa=False) == "s1"
    # each candidate with its own E T (online: S1's and S2's placements differ): t_D1 from the
    # first, t_D2 from the second
    assert choose_schedule(profile, 8, 4, 16, n_mp=2, n_esp=1, assignments_s2=64) == "s1"
    assert choose_schedule(profile, 8, 4, 64, n_mp=2, n_esp=1, assignments_s2=16) == "s2"


def test_fit_alpha_beta():
    sizes = [1e3, 1e4, 1e5, 1e6]
    exact = fit_alpha_beta(sizes, [2e-4 + 3e-9 * x for x in sizes])
    assert exact.alpha == pytest.approx(2e-4) and exact.beta == pytest.approx(3e-9) and exact.r2 == pytest.approx(1.0)
    noisy = fit_alpha_beta(sizes, [(2e-4 + 3e-9 * x) * (1 + 0.05 * (-1) ** i) for i, x in enumerate(sizes)])
    assert 0.95 < noisy.r2 < 1.0 and noisy.beta == pytest.approx(3e-9, rel=0.1)
    through_origin = fit_alpha_beta([1, 2, 3], [0.5, 2.0, 3.0])  # free fit has alpha < 0
    assert through_origin.alpha == 0.0 and through_origin.beta == pytest.approx(13.5 / 14)
    with pytest.raises(ValueError, match="two or more"):
        fit_alpha_beta([5, 5], [1.0, 2.0])


def test_profile_yaml_round_trip_and_errors(tmp_path):
    profile = HardwareProfile("p", AlphaBeta(1e-4, 2e-9, 0.99), AlphaBeta(3e-4, 4e-9), AlphaBeta(5e-4, 6e-9, 0.9),
                              description="d", fit={"layout": {"tensor": 2}})
    save_profile(profile, str(tmp_path / "p.yaml"))
    assert load_profile(str(tmp_path / "p.yaml")) == profile
    bad = tmp_path / "bad.yaml"
    for text, message in [("name: empty\n", "needs one or more of mp_allgather"),
                          ("mp_allgather: {alpha: 1, beta: 1}\nnccl: {alpha: 1, beta: 1}\n", "unknown: \\['nccl'\\]"),
                          ("mp_allgather: {alpha: 1, beta: -1}\nep_esp_alltoall: {alpha: 1, beta: 1}\n"
                           "saa: {alpha: 1, beta: 1}\n", ">= 0"),
                          ("mp_allgather: {alpha: 1}\nep_esp_alltoall: {alpha: 1, beta: 1}\nsaa: {alpha: 1, beta: 1}\n",
                           "keys alpha, beta"),
                          ("[1, 2\n", "perf.hardware_profile")]:
        bad.write_text(text)
        with pytest.raises(ConfigError, match=message) as info:
            load_profile(str(bad))
        assert "perf.hardware_profile" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="no such file"):
        load_profile(str(tmp_path / "missing.yaml"))
    # every op is optional in the file; what a technique needs is checked when it is configured
    partial = tmp_path / "partial.yaml"
    partial.write_text("mp_allgather: {alpha: 1, beta: 1}\n")
    with pytest.raises(ConfigError, match="moe.schedule=auto needs ep_esp_alltoall, saa in its hardware profile"):
        load_profile(str(partial)).require(("mp_allgather", "ep_esp_alltoall", "saa"), "moe.schedule=auto")


def test_shipped_profiles():
    a, b = (load_profile(str(p)) for p in TESTBEDS)
    assert (a.mp_allgather.alpha, a.mp_allgather.beta) == (6.64e-4, 5.38e-10)  # Parm §VI-B
    assert (b.mp_allgather.alpha, b.mp_allgather.beta) == (1.09e-4, 7.14e-10)
    measured = load_profile(str(ROOT / "configs/hardware/cpu_gloo_8proc.yaml"))
    assert all(0.0 < op.r2 <= 1.0 for op in (measured.mp_allgather, measured.ep_esp_alltoall, measured.saa))
    assert measured.fit["layout"] == {"tensor": 2, "expert": 2, "expert_shard": 2}


def test_config_rules(tmp_path):
    profile = str(TESTBEDS[0])
    validate_config(load_config(None, ["moe.schedule=auto", f"perf.hardware_profile={profile}", "moe.saa=true"]), 1)
    validate_config(load_config(None, ["moe.schedule=s2", "moe.saa=true", "parallel.tensor=2"]), 2)
    validate_config(load_config(None, ["moe.schedule=auto"]), 1)  # no profile: calibrated at start-up
    # S2 + SAA without an MP group: no MP-AllGather to overlap, N_EP blocking phases would be pure overhead
    with pytest.raises(ConfigError, match="^moe.saa=true with moe.schedule=s2 needs parallel.tensor > 1"):
        validate_config(load_config(None, ["moe.schedule=s2", "moe.saa=true", "parallel.expert=2"]), 2)
    validate_config(load_config(None, ["moe.schedule=auto", "moe.saa=true", "parallel.expert=2"]), 2)  # S1 picked
    for overrides, message in [(["moe.schedule=baseline", "moe.saa=true"], "needs moe.schedule s2 or auto"),
                               (["moe.schedule=s1", "moe.saa=true"], "moe.saa"),
                               (["moe.balancer=fastermoe", f"perf.hardware_profile={profile}"],
                                "moe.balancer=fastermoe needs p2p, broadcast in"),
                               (["moe.schedule=s1", f"perf.hardware_profile={tmp_path}/none.yaml"], "no such file")]:
        with pytest.raises(ConfigError, match=message):
            validate_config(load_config(None, overrides), 1)
    # auto's pick must agree over TP and ep_esp groups: one of the two sizes divides the other
    auto = ["moe.schedule=auto", f"perf.hardware_profile={profile}", "moe.num_experts=6", "parallel.tensor=2",
            "training.micro_batch_size=1", "training.global_batch_size=12"]
    with pytest.raises(ConfigError, match=r"parallel.tensor=2 and parallel.expert\*parallel.expert_shard=3"):
        validate_config(load_config(None, auto + ["parallel.expert=3"]), 6)
    validate_config(load_config(None, auto + ["parallel.expert=3", "moe.schedule=s2"]), 6)  # fixed picks: fine
    validate_config(load_config(None, auto + ["moe.num_experts=4", "parallel.expert=4"]), 8)


def test_single_process_schedules_equal_reference():
    """Groups of size 1: every collective is the identity and SAA has one phase, no peer."""
    state = ParallelState.single_process()
    for (schedule, saa), index in zip([("s1", False), ("s2", False), ("s2", True), ("auto", True)], range(len(CASES))):
        cfg, full, xs, gs = case_data(index, 1)
        cfg.moe.schedule, cfg.moe.saa, cfg.perf.hardware_profile = schedule, saa, str(TESTBEDS[1])
        result = run_layer(state, cfg, full, xs, gs)
        check_against_reference([result], index, RankLayout(world_size=1), schedule)
        assert result["stats"].schedule == ("s1" if schedule == "auto" else schedule)


class _FixedRows:
    """A stand-in balancer whose placement puts `rows` on each EP rank whatever the counts say."""

    def __init__(self, rows):
        self.rows, self.calls = rows, []

    def plan(self, counts, source_ep_ranks):
        self.calls.append((counts.clone(), list(source_ep_ranks)))
        rows = torch.tensor(self.rows)
        return type("Rows", (), {"tokens_per_ep_rank": lambda _: rows})()


def test_auto_chooses_from_the_balancers_placement(tmp_path):
    """Alg. 1's E T comes from the rows the balancer's Placement gives each EP rank (route -> plan
    -> choose), one plan per candidate with that candidate's per-source counts."""
    from megatron_moe.moe.router import Router, kept_counts
    from megatron_moe.techniques.parm.parm import Auto, AutoRouted

    layout = RankLayout(world_size=4, tensor=2, expert=2)
    state = ParallelState.build(layout, rank=0)  # no process group: tp/ep_esp sizes only
    cfg, full, xs, _ = case_data(0, 1)  # dropless top-2, B S = 8 tokens: 16 assignments
    cfg.moe.schedule, cfg.moe.saa = "auto", True
    # threshold profile: t_D1 = B L M, t_D2 = 0.5 (E T) M N_ESP / N_MP -> S1 iff E T >= 32
    cfg.perf.hardware_profile = str(tmp_path / "threshold.yaml")
    save_profile(HardwareProfile("t", AlphaBeta(0, 1), AlphaBeta(0, 0), AlphaBeta(0, 0.5)), cfg.perf.hardware_profile)
    router = Router(cfg, state)
    router.weight.data.copy_(full["router.weight"])
    x = xs[0].reshape(-1, xs.shape[-1])
    routing = router(x)
    counts = torch.tensor([[4, 4, 0, 0], [0, 0, 4, 4]])  # balanced per source: owner loads 8 / 8
    auto = Auto(cfg, state)
    for rows, expected in [([8, 8], "s2"), ([16, 0], "s1")]:  # E T = max rows * N_MP = 16 / 32
        balancer = _FixedRows(rows)
        kept = kept_counts(routing.expert_ids, routing.kept, 4)  # host: the micro-batch's kept counts
        routed = AutoRouted(routing, counts, router, x, counts.flip(0), kept)
        auto.place(routed, balancer)
        assert routed.chosen.choice == expected, rows
        assert [c[1] for c in balancer.calls] == [[0, 1], [0, 1]]  # sources = ep_esp ranks -> EP ranks
        assert torch.equal(balancer.calls[0][0], counts.flip(0)) and torch.equal(balancer.calls[1][0], counts)


def test_auto_and_the_balancers_without_a_profile(tmp_path, monkeypatch, one_thread):
    """Library use without `perf.hardware_profile` (review issue #27 item 2): a schedule or
    balancer built on its own says in one line what to pass; a model calibrates on its ranks as
    the trainer does (`resolve_hardware_profile`) and runs."""
    from megatron_moe.model.gpt import GPTMoEModel
    from megatron_moe.moe.balancers import BALANCERS
    from megatron_moe.moe.schedules import SCHEDULES

    monkeypatch.setenv("MEGATRON_MOE_CACHE", str(tmp_path))
    state = ParallelState.single_process()
    cfg = load_config("configs/gpt_moe_tiny.yaml", ["moe.schedule=auto", "model.seq_length=8"])
    builders = [("moe.schedule=auto", lambda: SCHEDULES.get("auto")(cfg, state))]
    builders += [(f"moe.balancer={name}", lambda name=name: BALANCERS.get(name)(cfg, state))
                 for name in ("fastermoe", "flexmoe", "proprophet")]
    for who, build in builders:
        with pytest.raises(ConfigError, match=f"^{who} needs perf.hardware_profile: set it, or pass the config "
                                              "through training.calibrate.resolve_hardware_profile") as error:
            build()
        assert "\n" not in str(error.value)
    model = GPTMoEModel(cfg, state)
    assert model.cfg.perf.hardware_profile.startswith(str(tmp_path / "hardware"))
    tokens = torch.randint(0, 1000, (2, 8), generator=torch.Generator().manual_seed(0))
    out = model(tokens, tokens)
    assert torch.isfinite(out.lm_loss) and [s.schedule for s in out.moe_stats] == ["s1", "s1"]  # N_MP = 1: S1
