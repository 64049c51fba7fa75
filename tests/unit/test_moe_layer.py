"""MoELayer on one process (all groups of size 1) against the reference, plus its statistics."""
import torch

from megatron_moe.config.schema import Config
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.moe.layer import MoELayer
from megatron_moe.moe.stats import MoEStats
from tests.moe_reference import load_full_weights_, random_full_weights, reference_moe

FP32 = dict(rtol=1e-5, atol=1e-6)


def test_single_process_layer_equals_reference():
    for seed, (capacity_factor, top_k, activation, bias) in enumerate([(1.0, 2, "swiglu", True),
                                                                      (None, 1, "gelu", False)]):
        cfg = Config()
        cfg.model.hidden_size, cfg.model.activation, cfg.model.bias = 8, activation, bias
        cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.capacity_factor = 4, top_k, capacity_factor
        cfg.moe.expert_ffn_hidden_size, cfg.moe.aux_loss_coeff, cfg.moe.z_loss_coeff = 6, 0.1, 0.01
        state = ParallelState.single_process()
        full = random_full_weights(cfg, seed)
        layer = MoELayer(cfg, state, layer_index=0)
        load_full_weights_(layer, full, state)
        gen = torch.Generator().manual_seed(seed)
        x, g = torch.randn(3, 4, 8, generator=gen), torch.randn(3, 4, 8, generator=gen)
        x_layer = x.clone().requires_grad_(True)
        y, aux = layer(x_layer)
        ((y * g).sum() + aux).backward()
        weights = {n: t.clone().requires_grad_(True) for n, t in full.items()}
        x_ref = x.reshape(12, 8).clone().requires_grad_(True)
        ref = reference_moe(x_ref, weights, cfg)
        ((ref.y * g.reshape(12, 8)).sum() + ref.aux_loss).backward()
        torch.testing.assert_close(y.reshape(12, 8), ref.y.detach(), **FP32)
        torch.testing.assert_close(aux, ref.aux_loss.detach(), **FP32)
        torch.testing.assert_close(x_layer.grad.reshape(12, 8), x_ref.grad, **FP32)
        for name, p in layer.named_parameters():
            torch.testing.assert_close(p.grad, weights[name].grad, **FP32)
        stats = layer.last_stats
        assert stats.tokens_per_expert.tolist() == ref.tokens_per_expert and stats.dropped == ref.dropped
        assert stats.tokens_per_ep_rank.tolist() == [sum(ref.kept_per_expert)]


def test_load_imbalance():
    stats = MoEStats(torch.tensor([4, 4]), 0, torch.tensor([6, 2]))
    assert stats.load_imbalance == 1.5
    assert MoEStats(torch.zeros(2, dtype=torch.long), 0, torch.zeros(2, dtype=torch.long)).load_imbalance == 1.0


_FOREIGN_EXPERT = """
import torch
from megatron_moe.config.schema import Config
from megatron_moe.distributed.parallel_state import ParallelState, RankLayout
from megatron_moe.moe.experts import ExpertBatch, Experts
cfg = Config()
cfg.moe.num_experts = 4
state = ParallelState.build(RankLayout(world_size=2, expert=2), rank=0)  # owns experts 0 and 1
experts = Experts(cfg, state)
x = torch.randn(3, cfg.model.hidden_size)
try:
    experts(ExpertBatch(x, [0, 1, 2], [1, 1, 1]))  # expert 2: owned by EP rank 1, no replica received
except LookupError as exc:
    print("raised:", exc)
"""


def test_an_expert_without_weights_raises_even_under_python_O():
    """Review #15 item 2: an assert guarded this; `python -O` dropped it and the rank silently used
    another expert's weights. Now the lookup raises whatever the interpreter flags."""
    import subprocess
    import sys

    for flags in ([], ["-O"]):
        proc = subprocess.run([sys.executable, *flags, "-c", _FOREIGN_EXPERT], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert "raised: EP rank 0 was asked to compute expert(s) [2]" in proc.stdout, (flags, proc.stdout)
