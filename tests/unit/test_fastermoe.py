"""FasterMoE's shadowing decision (Alg. 1, Eq. 7-10) on worked examples and against a brute-force
search over all shadow sets (techniques/fastermoe/fastermoe.py, techniques/fastermoe/fastermoe_model.py)."""
import itertools
import statistics

import pytest
import torch

from megatron_moe.techniques.fastermoe.fastermoe import rows_per_rank, select_shadow_experts, shadow_loads
from megatron_moe.moe.placement import Placement
from megatron_moe.perf.alpha_beta import AlphaBeta
from megatron_moe.techniques.fastermoe.fastermoe_model import ShadowCostModel
from megatron_moe.perf.hardware import HardwareProfile

# the paper's GeLU MLP, alpha = 2, H = 4: F = 4 alpha H^2 = 128 FLOPs per row, Q = 2 alpha H^2 = 64;
# 0.1 ms per FLOP, 1 ms per element sent: Lat_imbl(B) = 3*128*1e-4 B + 4*4*1e-3 B = 0.0544 B and
# Lat_shadow(r, B') = 0.0544 B' + 0.128 r (token term kept: moe.fastermoe.eq8=token_term)
MODEL = ShadowCostModel(flops_per_row=128, params_per_expert=64, hidden=4, seconds_per_flop=1e-4,
                        seconds_per_token_element=1e-3, seconds_per_param_element=1e-3, eq8="token_term")


def _cost(T, shadowed, model=MODEL):
    """Eq. 7 without shadows, Eq. 8 with: the quantity Alg. 1 minimizes."""
    b_max = float(shadow_loads(T, list(shadowed)).max())
    return model.lat_shadow(len(shadowed), b_max) if shadowed else model.lat_imbl(b_max)


def _brute_force(T, model=MODEL):
    experts = range(T.shape[1])
    return min((_cost(T, s, model), list(s)) for r in range(len(experts) + 1) for s in itertools.combinations(experts, r))


def test_figure_6_shadows_the_popular_expert():
    """Fig. 6: 3 workers, one expert each; every worker sends 6 tokens to expert 1 and 1 to the others."""
    T = torch.tensor([[1, 6, 1], [1, 6, 1], [1, 6, 1]])
    assert shadow_loads(T, []).tolist() == [3, 18, 3]
    # Alg. 1 lines 6-9: each worker computes its own 6 rows of expert 1 (+ the 3 rows of the expert it owns)
    assert shadow_loads(T, [1]).tolist() == [9, 6, 9]
    assert MODEL.lat_imbl(18) == pytest.approx(0.9792)  # 0.0544 * 18
    assert MODEL.lat_shadow(1, 9) == pytest.approx(0.6176)  # 0.0544 * 9 + 0.128
    assert select_shadow_experts(T, MODEL) == [1] == _brute_force(T)[1]
    # shadowing expert 0 as well: loads [7, 7, 10], 0.8 s > 0.6176 s, so Alg. 1 stops
    assert MODEL.lat_shadow(2, float(shadow_loads(T, [1, 0]).max())) == pytest.approx(0.8)


def test_balanced_load_shadows_nothing_and_min_shadow_forces():
    T = torch.full((4, 4), 5)
    assert select_shadow_experts(T, MODEL) == [] == _brute_force(T)[1]
    assert select_shadow_experts(T, MODEL, min_shadow=2) == [0, 1]  # ties: lower expert id first


def test_the_printed_eq8_counts_the_remaining_token_traffic_as_saved():
    """Shadowing the popular expert 1 trims the busiest rank's load only from 22 to 20 rows. The
    paper's Eq. 8 (the default) drops the token term, so it books all of Eq. 7's all-to-all time as
    saved and shadows; with the token term (eq8=token_term) the 2 rows saved do not pay for moving the weights."""
    T = torch.tensor([[5, 2], [5, 20]])  # EP ranks 0, 1; expert 1 lives on EP rank 1
    assert shadow_loads(T, []).tolist() == [10, 22] and shadow_loads(T, [1]).tolist() == [12, 20]
    assert select_shadow_experts(T, MODEL) == []  # 0.0544 * 20 + 0.128 > 0.0544 * 22
    paper = ShadowCostModel(128, 64, 4, 1e-4, 1e-3, 1e-3, eq8="printed")
    assert select_shadow_experts(T, paper) == [1]  # 0.0384 * 20 + 0.128 < 0.0544 * 22


def test_alg1_stops_at_the_first_expert_that_does_not_help():
    """Two equally hot experts on different ranks: shadowing one leaves the other's rank the
    bottleneck, so Alg. 1 stops with neither, while shadowing both is best (docs/balancers.md)."""
    hot = torch.tensor([[1, 9, 1, 9]] * 4)
    assert shadow_loads(hot, []).tolist() == [4, 36, 4, 36] and shadow_loads(hot, [1]).tolist() == [13, 9, 13, 45]
    assert select_shadow_experts(hot, MODEL) == [] and _brute_force(hot)[1] == [1, 3]
    # same rank: the second hot expert is the next in line and the busiest rank's load falls
    same_rank = torch.tensor([[9, 9, 1, 1]] * 4)  # experts 0, 1 on EP rank 0 of 2
    assert select_shadow_experts(same_rank.view(4, 4)[:2], MODEL) == [0, 1] == _brute_force(same_rank[:2])[1]


def test_eq9_eq10_decide_the_first_shadow():
    """With the paper's Eq. 8, a first shadow that does not raise the busiest load (B'_max <= B_max)
    is taken iff Eq. 9 (B_max > r Q / 2H) or Eq. 10 (3 (B_max - B'_max) F / (2 r Q - 4 H B_max) >
    P / W_net) holds, i.e. Lat_shadow(1) < Lat_imbl."""
    P_over_W = 1.0  # same per-FLOP and per-element seconds
    for q in (16.0, 64.0, 256.0, 1024.0):
        model = ShadowCostModel(128, q, 4, 1e-3, 1e-3, 1e-3, eq8="printed")  # the paper's Eq. 8
        for T in (torch.tensor([[1, 6, 1], [1, 6, 1], [1, 6, 1]]), torch.tensor([[5, 2], [5, 20]]),
                  torch.tensor([[2, 30], [2, 1]])):
            b_max = float(shadow_loads(T, []).max())
            first = int(torch.argsort(T.sum(0), descending=True, stable=True)[0])
            b_shadow = float(shadow_loads(T, [first]).max())
            if b_shadow > b_max:
                continue  # Eq. 9 / 10 assume the shadow does not raise the maximum load
            eq9 = b_max > q / (2 * 4)
            eq10 = (2 * q - 16 * b_max) > 0 and 3 * (b_max - b_shadow) * 128 / (2 * q - 16 * b_max) > P_over_W
            assert (select_shadow_experts(T, model)[:1] == [first]) == (eq9 or eq10) == \
                model.shadow_is_faster(1, b_max, b_shadow), (q, T.tolist())


def test_against_brute_force_on_random_small_layers():
    """Alg. 1 is greedy (popularity order, stop at the first non-improving expert): never worse
    than not shadowing, and close to the best shadow set (measured: 119 of 300 optimal, mean
    cost 1.08x the optimum, worst 1.50x; docs/balancers.md)."""
    gen = torch.Generator().manual_seed(1)
    gaps = []
    for trial in range(300):
        ep = (2, 3, 4)[trial % 3]
        T = torch.randint(0, 50, (ep, ep * (1 + trial % 2)), generator=gen)
        T[:, int(torch.randint(0, T.shape[1], (1,), generator=gen))] *= int(torch.randint(1, 8, (1,), generator=gen))
        model = ShadowCostModel(128, float(torch.randint(10, 400, (1,), generator=gen)), 4, 1e-3, 1e-3, 1e-3,
                                "token_term")
        chosen = _cost(T, select_shadow_experts(T, model), model)
        assert chosen <= _cost(T, [], model) + 1e-12
        gaps.append(chosen / _brute_force(T, model)[0])
    assert statistics.mean(gaps) < 1.1 and max(gaps) < 1.6


def test_shadowed_placement_keeps_rows_at_their_source():
    counts = torch.tensor([[3, 1, 0, 2], [1, 2, 2, 0], [0, 4, 1, 1], [2, 0, 0, 3]])  # 4 sources on 2 EP ranks
    sources = [0, 0, 1, 1]
    T = rows_per_rank(counts, sources, 2)
    assert T.tolist() == [[4, 3, 2, 2], [2, 4, 1, 4]]
    p = Placement.shadowed(counts, 2, [1], sources)
    assert p.replicas == ((0,), (0, 1), (1,), (1,)) and p.num_replicas == 1
    assert p.routing_table[:, 1].tolist() == [[1, 0], [2, 0], [0, 4], [0, 0]]  # each source's rows stay local
    # EP rank 0: its own 3 rows of expert 1 + all 6 of expert 0; rank 1: its 4 of expert 1 + experts 2, 3
    assert p.tokens_per_ep_rank().tolist() == shadow_loads(T, [1]).tolist() == [3 + 6, 4 + 3 + 6]


def test_cost_model_reads_the_profile():
    ab = AlphaBeta
    profile = HardwareProfile("p", p2p=ab(1e-5, 2e-9), broadcast=ab(1e-5, 3e-9), expert_compute=ab(1e-4, 5e-12))
    model = ShadowCostModel.from_profile(profile, flops_per_row=100.0, params_per_expert=10.0, hidden=8)
    assert model.lat_imbl(10) == pytest.approx(3 * 100 * 10 * 5e-12 + 4 * 10 * 8 * 2e-9)
    compute = 3 * 100 * 10 * 5e-12
    assert model.lat_shadow(2, 10) == pytest.approx(compute + 2 * 2 * 10 * 3e-9)  # Eq. 8 as printed (default)
    kept = ShadowCostModel.from_profile(profile, flops_per_row=100.0, params_per_expert=10.0, hidden=8, eq8="token_term")
    assert kept.lat_shadow(2, 10) == pytest.approx(model.lat_imbl(10) + 2 * 2 * 10 * 3e-9)
    release = ShadowCostModel.from_profile(profile, flops_per_row=100.0, params_per_expert=10.0, hidden=8, eq8="fastmoe")
    assert release.lat_shadow(2, 10) == pytest.approx(model.lat_imbl(10) + 2 * 10 * 3e-9)  # one send per shadow
    with pytest.raises(Exception, match="moe.balancer=fastermoe needs broadcast, expert_compute"):
        ShadowCostModel.from_profile(HardwareProfile("q", p2p=ab(0, 1)), 1.0, 1.0, 1)


def test_incremental_loads_choose_what_the_loads_from_scratch_choose():
    """Alg. 1 derives each candidate's loads from the accepted set's; the reference recomputes
    them from T for every candidate: the same shadow sets on random skewed layers (ties included)."""
    from tests.dense_reference import reference_shadow_experts

    gen = torch.Generator().manual_seed(7)
    for trial in range(200):
        ep = int(torch.randint(1, 9, (1,), generator=gen))
        experts = ep * int(torch.randint(1, 5, (1,), generator=gen))
        hot = torch.rand(experts, generator=gen) ** 4 * 40  # a few popular experts
        T = torch.poisson(hot.expand(ep, experts).contiguous(), generator=gen).long()
        if trial % 4 == 0:
            T = T // 5  # small counts: many equal totals
        q = float(torch.randint(1, 200, (1,), generator=gen))
        model = ShadowCostModel(128, q, 4, 1e-4, 1e-3, 1e-3, eq8=("printed", "token_term")[trial % 2])
        for min_shadow in (0, 2):
            assert select_shadow_experts(T, model, min_shadow) == reference_shadow_experts(T, model, min_shadow), \
                (T.tolist(), q, min_shadow)


def test_fastmoe_release_walks_expert_counts():
    """FastMoE's release (eq8=fastmoe): Eq. 7 at the largest expert's total rows (24), then, for
    shadowing the first i + 1, at the (i+1)-th largest plus i + 1 sends of 64 parameters:
    0.0544 x 24 = 1.306; shadow expert 1: 0.0544 x 10 + 0.064 = 0.608; shadow 1 and 0: 0.0544 x 3
    + 0.128 = 0.291; then 0.0544 x 2 + 0.192 = 0.301 does not gain."""
    from megatron_moe.techniques.fastermoe.fastermoe import fastmoe_release_shadow
    release = ShadowCostModel(128, 64, 4, 1e-4, 1e-3, 1e-3, eq8="fastmoe")
    T = torch.tensor([[5, 12, 1, 1], [5, 12, 2, 1]])  # totals [10, 24, 3, 2]
    assert fastmoe_release_shadow(T, release) == [0, 1]
    assert fastmoe_release_shadow(T, release, min_shadow=3) == [0, 1, 2]


def test_default_eq8_is_the_printed_formula(tmp_path):
    """The default `moe.fastermoe.eq8` is FasterMoE's Eq. 8 as printed (§4.1):
    Lat_shadow(r, B') = max_w {3 * 4 B'_w alpha H^2 / P} + 2 r * 2 alpha H^2 / W_net, no token term.
    Worked by hand on the paper's GeLU MLP, alpha = 2, H = 4 (hidden 4, expert FFN 8, no bias):
    F = 4 alpha H^2 = 2 * 4 * 8 * 2 = 128 FLOPs per row, Q = 2 alpha H^2 = 4 * (8 + 8) = 64; 1 / P =
    1e-4 s per FLOP, 1 / W_net = 1e-3 s per element (tokens and parameters). r = 2, B'_max = 10:
        printed     3 * 128 * 10 * 1e-4 + 2 * 2 * 64 * 1e-3            = 0.384 + 0.256 = 0.640 s
        token_term  0.640 + 4 * 10 * 4 * 1e-3 (Eq. 7's token term)     = 0.640 + 0.160 = 0.800 s
    and the decision of test_the_printed_eq8_counts_the_remaining_token_traffic_as_saved: T = [[5, 2],
    [5, 20]], Lat_imbl(22) = 0.8448 + 0.352 = 1.1968 s; shadowing expert 1 (B'_max 20) costs 0.768 +
    0.128 = 0.896 s printed (shadow), 0.896 + 0.320 = 1.216 s with the token term (do not)."""
    from types import SimpleNamespace

    import yaml

    from megatron_moe.config import load_config
    from megatron_moe.techniques.fastermoe.fastermoe import FasterMoE

    profile = tmp_path / "eq8.yaml"
    profile.write_text(yaml.safe_dump({"name": "eq8", "p2p": {"alpha": 0.0, "beta": 1e-3},
                                       "broadcast": {"alpha": 0.0, "beta": 1e-3},
                                       "expert_compute": {"alpha": 0.0, "beta": 1e-4}}))
    cfg = load_config(None, ["model.hidden_size=4", "moe.expert_ffn_hidden_size=8", "model.bias=false",
                             "moe.num_experts=2", "moe.balancer=fastermoe", f"perf.hardware_profile={profile}"])
    assert cfg.moe.fastermoe.eq8 == "printed"  # the schema default
    balancer = FasterMoE(cfg, SimpleNamespace(ep_size=2, esp_size=1))
    assert (balancer.cost.flops_per_row, balancer.cost.params_per_expert, balancer.cost.eq8) == (128, 64, "printed")
    assert balancer.cost.lat_shadow(2, 10) == pytest.approx(0.640)
    assert balancer.cost.lat_imbl(22) == pytest.approx(1.1968)
    assert balancer.cost.lat_shadow(1, 20) == pytest.approx(0.896)
    assert balancer.plan(torch.tensor([[5, 2], [5, 20]]), [0, 1]).replicas == ((0,), (1, 0))  # expert 1 shadowed
    plain = ShadowCostModel(128, 64, 4, 1e-4, 1e-3, 1e-3)  # the cost model's own default
    assert plain.eq8 == "printed" and plain.lat_shadow(2, 10) == pytest.approx(0.640)
    kept = ShadowCostModel(128, 64, 4, 1e-4, 1e-3, 1e-3, eq8="token_term")
    assert kept.lat_shadow(2, 10) == pytest.approx(0.800) and kept.lat_shadow(1, 20) == pytest.approx(1.216)
