"""`training.compile` (model/compile.py): TorchInductor-compiled layers give the eager run's losses,
gradients and dropout stream (dropout 0.1, capacity drops, two steps), GPT and BERT, alone and
under activation recomputation and Lancet's partitioned forward."""
import pytest

from tests.tiny_model import assert_same_steps, tiny_model_steps


@pytest.mark.parametrize("bert", [False, True], ids=["gpt", "bert"])
def test_compile_is_exact(bert):
    plain = tiny_model_steps([], bert, steps=2)
    assert sum(plain[0].dropped) > 0
    runs = [[], ["training.recompute=full"], ["training.recompute=selective"]]
    if not bert:
        runs.append(["moe.lancet.partitions=2"])
    for extra in runs:
        got = tiny_model_steps(["training.compile=true"] + extra, bert, steps=2)
        assert_same_steps(got, plain, f"compile {extra}")


def test_compile_installs_the_compiled_moe_pieces():
    """`compile_layers` gives every MoE layer the one shared compiled activation and combine
    (model/compile.py); an eager model keeps the plain functions."""
    import torch

    from megatron_moe.config import load_config
    from megatron_moe.distributed.parallel_state import ParallelState
    from megatron_moe.model.compile import compile_layers
    from megatron_moe.model.gpt import GPTMoEModel
    from megatron_moe.model.mlp import ffn_activation
    from megatron_moe.moe.schedules.base import gate_weighted_sum

    cfg = load_config("configs/mixtral_tiny.yaml", ["logging.tensorboard=false"])
    model = GPTMoEModel(cfg, ParallelState.single_process())
    layers = [layer for layer in model.modules() if getattr(layer, "is_moe", False)]
    assert len(layers) == cfg.model.num_layers
    assert all(layer.ffn.schedule.weighted_sum is gate_weighted_sum
               and layer.ffn.experts.activation_fn is ffn_activation for layer in layers)
    compile_layers(layers)
    sums = {id(layer.ffn.schedule.weighted_sum) for layer in layers}
    activations = {id(layer.ffn.experts.activation_fn) for layer in layers}
    assert len(sums) == len(activations) == 1
    compiled = layers[0].ffn.schedule.weighted_sum
    assert compiled is not gate_weighted_sum and layers[0].ffn.experts.activation_fn is not ffn_activation
    rows, weights = torch.randn(6, 4), torch.rand(4, 2)
    slots = torch.tensor([0, 3, 4, 7, 1, 6])
    assert torch.allclose(compiled(rows, weights, slots, 4), gate_weighted_sum(rows, weights, slots, 4))
