"""Router: top-k weights, capacity and position-based drops, aux and z losses (hand-computed)."""
import math

import pytest
import torch

from megatron_moe.config.schema import Config
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.moe.router import (Router, capacity_keep, expert_capacity, load_balancing_loss, top_k_gating,
                                     z_loss)

# 3 tokens, 2 experts: probabilities [.75, .25], [.2, .8], [.6, .4]
LOGITS = torch.tensor([[math.log(3.0), 0.0], [0.0, math.log(4.0)], [math.log(1.5), 0.0]])


def test_switch_top1_keeps_probability_and_gshard_top2_renormalizes():
    probs, ids, weights = top_k_gating(LOGITS, 1)
    torch.testing.assert_close(probs, torch.tensor([[0.75, 0.25], [0.2, 0.8], [0.6, 0.4]]))
    assert ids.tolist() == [[0], [1], [0]]
    torch.testing.assert_close(weights, torch.tensor([[0.75], [0.8], [0.6]]))
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.3, 0.6]]))
    _, ids, weights = top_k_gating(logits, 2)
    assert ids.tolist() == [[0, 1], [2, 1]]
    torch.testing.assert_close(weights, torch.tensor([[0.625, 0.375], [2 / 3, 1 / 3]]))


def test_aux_and_z_loss_hand_computed():
    probs, ids, _ = top_k_gating(LOGITS, 1)
    counts = torch.bincount(ids.flatten(), minlength=2)  # [2, 1]
    # E * sum_e f_e P_e = 2 * (2/3 * 1.55/3 + 1/3 * 1.45/3)
    expected = 2 * (2 / 3 * (0.75 + 0.2 + 0.6) / 3 + 1 / 3 * (0.25 + 0.8 + 0.4) / 3)
    assert load_balancing_loss(probs, counts, 1).item() == pytest.approx(expected, rel=1e-6)
    # balanced top-2 over 2 experts: f = P = 1/2 -> 1
    uniform = torch.full((4, 2), 0.5)
    assert load_balancing_loss(uniform, torch.tensor([4, 4]), 2).item() == pytest.approx(1.0)
    # logsumexp rows: log 4, log 5, log 2.5
    expected_z = (math.log(4) ** 2 + math.log(5) ** 2 + math.log(2.5) ** 2) / 3
    assert z_loss(LOGITS).item() == pytest.approx(expected_z, rel=1e-6)


def test_capacity_formula():
    assert expert_capacity(8, 4, 2, 1.0) == 4
    assert expert_capacity(6, 4, 1, 1.25) == 2  # ceil(1.875)
    assert expert_capacity(8, 4, 2, None) is None


def test_drops_by_token_position_whatever_the_choice_rank():
    ids = torch.tensor([[0, 1], [1, 0], [0, 2], [2, 0], [1, 2]])  # 5 tokens, k = 2, E = 3
    capacity = expert_capacity(5, 3, 2, 0.6)  # ceil(2.0) = 2
    kept = capacity_keep(ids, 3, capacity)
    # expert 0 takes t0, t1 (t1's second choice beats t2's first); expert 1 t0, t1; expert 2 t2, t3
    assert kept.tolist() == [[True, True], [True, True], [False, True], [True, False], [False, False]]
    assert capacity_keep(ids, 3, None).all()
    # a schedule that splits the tokens keeps the same ones by passing earlier pieces' counts
    prior = torch.bincount(ids[:3].flatten(), minlength=3)
    pieces = torch.cat([capacity_keep(ids[:3], 3, capacity), capacity_keep(ids[3:], 3, capacity, prior)])
    assert torch.equal(pieces, kept)


def _router(top_k, capacity_factor):
    cfg = Config()
    cfg.model.hidden_size, cfg.moe.num_experts, cfg.moe.top_k = 8, 4, top_k
    cfg.moe.capacity_factor, cfg.moe.aux_loss_coeff, cfg.moe.z_loss_coeff = capacity_factor, 0.1, 0.01
    router = Router(cfg, ParallelState.single_process())
    with torch.no_grad():
        router.weight.copy_(torch.randn(4, 8, generator=torch.Generator().manual_seed(0)))
    return router


def test_router_module_combines_the_pieces():
    router = _router(top_k=2, capacity_factor=1.0)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    routing = router(x)
    logits = x @ router.weight.detach().t()
    probs, ids, weights = top_k_gating(logits, 2)
    assert torch.equal(routing.expert_ids, ids)
    torch.testing.assert_close(routing.weights, weights)
    assert routing.tokens_per_expert.tolist() == torch.bincount(ids.flatten(), minlength=4).tolist()
    assert torch.equal(routing.kept, capacity_keep(ids, 4, 3))  # ceil(6 * 2 / 4)
    assert routing.dropped == int((~routing.kept).sum())
    expected = 0.1 * load_balancing_loss(probs, routing.tokens_per_expert, 2) + 0.01 * z_loss(logits)
    torch.testing.assert_close(routing.aux_loss, expected)


def test_router_runs_in_fp32_under_bf16_autocast():
    router = _router(top_k=1, capacity_factor=None)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        routing = router(x)
    expected = router(x.float())
    assert routing.weights.dtype == torch.float32 and routing.aux_loss.dtype == torch.float32
    assert torch.equal(routing.weights, expected.weights) and torch.equal(routing.expert_ids, expected.expert_ids)
