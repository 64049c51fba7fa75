"""moe.expert_bias (moe/expert_bias.py): the loads a layer's training forwards routed, and the step's
update b += rate * sign(mean load - load), outside autograd, changing selection but not weights."""
import torch

from megatron_moe.config.schema import Config
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.moe.expert_bias import update_expert_biases
from megatron_moe.moe.layer import MoELayer

SINGLE = ParallelState.single_process()


def _layer():
    cfg = Config()
    cfg.model.hidden_size, cfg.moe.num_experts, cfg.moe.top_k = 8, 4, 1
    cfg.moe.score_function, cfg.moe.expert_bias, cfg.moe.norm_topk_prob = "sigmoid", True, False
    return MoELayer(cfg, SINGLE, 0)


def test_bias_update_follows_the_loads_of_training_forwards_only():
    layer = _layer()
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.expert_bias.zero_()  # (init_model_from_seed_ zeroes it in training)
        layer.router.weight[0, 0] = 5.0  # every token with x_0 > 0 prefers expert 0
    x = torch.zeros(1, 6, 8)
    x[..., 0] = 1.0
    layer(x)[0].sum().backward()
    layer(x)[0].sum().backward()  # two micro-batches: 12 assignments to expert 0
    with torch.no_grad():
        layer(x)  # evaluation: not counted
    assert layer.router.loads.load.tolist() == [12, 0, 0, 0]
    update_expert_biases([layer], SINGLE, rate=0.1)
    torch.testing.assert_close(layer.router.expert_bias, torch.tensor([-0.1, 0.1, 0.1, 0.1]))  # mean 3: 0 down, rest up
    assert layer.router.loads.load is None and layer.router.expert_bias.grad is None
    # selection moves once the bias outweighs the score gap; the weight is still the unbiased score
    with torch.no_grad():
        layer.router.expert_bias.copy_(torch.tensor([-2.0, 1.0, 0.0, 0.0]))
        probs, ids, weights = layer.router.select(layer.router.logits(x[0]))
    assert ids[:, 0].tolist() == [1] * 6
    torch.testing.assert_close(weights[:, 0], torch.sigmoid(torch.zeros(6)))
