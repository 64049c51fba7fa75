"""moe.expert_bias (moe/expert_bias.py): the loads a layer's training forwards routed, and the step's
update b += rate * sign(mean load - load), outside autograd, changing selection but not weights."""
import pytest
import torch

from megatron_moe.config import load_config
from megatron_moe.config.schema import Config
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.moe.expert_bias import update_expert_biases
from megatron_moe.moe.layer import MoELayer
from megatron_moe.training.trainer import Trainer
from tests.checkpoint_helpers import synthetic_datasets

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


def test_bf16_keeps_the_bias_fp32_and_checkpoints_it(tmp_path):
    """`training.precision=bf16` on the DeepSeek-style config with QK-norm and the shared-expert gate
    on: the trained new parameters (q/k norms, shared expert and its gate) are bf16 with fp32 main
    gradients and masters; the expert bias stays fp32 outside the optimizer (no master, no moments,
    no decay), is saved as it is by a ZeRO-1 run, and a resumed run (the plain optimizer, whose
    masters are loaded by name) gets it back bit for bit."""
    from megatron_moe.training.checkpoint_io import read_metadata

    base = ["training.train_iters=1", "training.log_interval=1", "training.eval_interval=0", "model.seq_length=8",
            "training.micro_batch_size=2", "training.global_batch_size=4", "model.vocab_size=64", "model.num_layers=1",
            "model.hidden_size=32", "moe.num_experts=8", "logging.tensorboard=false", "training.precision=bf16",
            "model.qk_norm=head", "moe.shared_expert_gate=true", "moe.expert_bias_rate=0.01",
            "checkpoint.save_interval=1", "checkpoint.keep_last=0", f"training.run_dir={tmp_path}/run",
            f"checkpoint.dir={tmp_path}/ckpt"]
    first = Trainer(load_config("configs/deepseek_routing_tiny.yaml", base + ["optimizer.distributed=true"]), SINGLE,
                    datasets=synthetic_datasets)
    first.train()
    named = dict(first.model.named_parameters())
    biases = {n: p.detach().clone() for n, p in named.items() if n.endswith("router.expert_bias")}
    assert len(biases) == 1 and all(b.dtype == torch.float32 and b.abs().sum() > 0 for b in biases.values())
    trained = [n for n, p in named.items() if p.requires_grad]
    assert set(trained) == set(named) - set(biases)
    assert all(named[n].dtype == torch.bfloat16 and named[n].main_grad.dtype == torch.float32 for n in trained)
    assert any("q_norm" in n for n in trained) and any("shared_expert.gate" in n for n in trained)
    keys = read_metadata(f"{tmp_path}/ckpt/iter_0000001").state_dict_metadata
    for name in biases:
        assert keys[f"model/{name}"].properties.dtype == torch.float32
        assert not [k for k in keys if k.startswith(f"optim/{name}/")]
    resumed = Trainer(load_config("configs/deepseek_routing_tiny.yaml",
                                  base + [f"checkpoint.load={tmp_path}/ckpt/iter_0000001"]), SINGLE,
                      datasets=synthetic_datasets)
    resumed.load_checkpoint()
    for name, bias in biases.items():
        got = dict(resumed.model.named_parameters())[name]
        assert got.dtype == torch.float32 and torch.equal(got.detach(), bias), name
