"""The MoE layer's per-call cost at decode sizes (docs/performance.md "Generation"): inference
forwards skip work that only training or several ranks need, with the training path's results."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_moe.config.schema import Config
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.moe import grouped_gemm
from megatron_moe.moe.layer import MoELayer
from megatron_moe.moe.placement import Placement, owner_table
from tests.moe_reference import load_full_weights_, random_full_weights


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("capacity_factor, budget", [(None, 100), (1.0, 125)])
def test_inference_forward_is_the_training_forward_with_fewer_ops(capacity_factor, budget):
    """4 tokens (one decode step of 4 prompts): the no-grad forward returns the grad-enabled one's
    output bit for bit, in at most `budget` ATen calls (153 dropless / 168 with capacity before the
    owners' layout was cached and the single-rank orders, the dropless -1 masks and the autograd
    Function of the expert GEMMs were skipped)."""
    cfg = Config()
    cfg.model.hidden_size, cfg.model.activation = 16, "swiglu"
    cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.capacity_factor, cfg.moe.expert_ffn_hidden_size = 4, 2, capacity_factor, 8
    state = ParallelState.single_process()
    layer = MoELayer(cfg, state, layer_index=0)
    load_full_weights_(layer, random_full_weights(cfg, 0), state)
    x = torch.randn(4, 1, 16, generator=torch.Generator().manual_seed(0))
    y_train, aux_train = layer(x.clone().requires_grad_(True))
    with torch.no_grad():
        layer(x)  # one-time probes and caches
        with _CountOps() as count:
            y, aux = layer(x)
    assert torch.isfinite(y).all() and torch.equal(y, y_train.detach()) and torch.equal(aux, aux_train.detach())
    assert count.ops <= budget, f"{count.ops} ATen calls for one MoE layer forward of 4 tokens (budget {budget})"


def test_owner_only_is_the_checked_placement(monkeypatch):
    """`Placement.owner_only` builds, unchecked and from a cached layout, what the checked
    constructor builds."""
    gen = torch.Generator().manual_seed(0)
    checked = {}
    for sources, experts, ep in [(1, 8, 1), (2, 8, 2), (4, 8, 4), (2, 6, 3)]:
        counts = torch.randint(0, 5, (sources, experts), generator=gen)
        checked[sources, experts, ep] = counts, Placement(*owner_table(counts, ep))
    monkeypatch.setattr(Placement, "__post_init__", lambda self: pytest.fail("owner_only ran the checks"))
    for (sources, experts, ep), (counts, ref) in checked.items():
        p = Placement.owner_only(counts, ep)
        assert p.replicas == ref.replicas and p.resident == ref.resident and torch.equal(p.routing_table, ref.routing_table)
        assert all(torch.equal(a, b) for a, b in zip(p._pairs, ref._pairs))
        for q in range(ep):
            assert torch.equal(p.destinations(min(q, sources - 1)), ref.destinations(min(q, sources - 1)))
            assert torch.equal(p.receive_order(q), ref.receive_order(q)) and p.experts_on(q) == ref.experts_on(q)


def test_grouped_mm_into_grad_without_grad_runs_no_autograd_function(monkeypatch):
    """Under no_grad the expert GEMM is the kernel alone: no autograd Function per call."""
    leaf = torch.nn.Parameter(torch.randn(3, 8, 16))
    x, counts = torch.randn(5, 8), [2, 0, 3]
    expected = torch.cat([x[:2] @ leaf[0], x[2:] @ leaf[2]]).detach()

    def refuse(*args, **kwargs):
        raise AssertionError("an autograd Function ran under no_grad")

    monkeypatch.setattr(grouped_gemm._GroupedMMIntoGrad, "apply", refuse)
    monkeypatch.setattr(grouped_gemm, "_grouped_mm_autograd", refuse)
    with torch.no_grad():
        y = grouped_gemm.grouped_mm_into_grad(x, leaf, 0.5, counts)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-6)
