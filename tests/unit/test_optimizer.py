"""optimizer.py: which parameters AdamW decays (by `ParamMeta.role`, not by rank) and what one
step does to them."""
import pytest
import torch

from megatron_moe.config.schema import Config, OptimizerConfig
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.bert import BertMoEModel
from megatron_moe.model.gpt import GPTMoEModel
from megatron_moe.training.optimizer import build_optimizer, param_groups

SINGLE = ParallelState.single_process()


def _config():
    cfg = Config()
    cfg.model.num_layers, cfg.model.hidden_size, cfg.model.ffn_hidden_size = 2, 16, 32
    cfg.model.num_attention_heads, cfg.model.seq_length, cfg.model.vocab_size = 2, 8, 40
    cfg.model.bias, cfg.model.tie_embeddings = True, False
    cfg.moe.num_experts, cfg.moe.layer_freq = 2, 2  # layer 0 dense FFN, layer 1 MoE
    return cfg


def _layer_names(i, ffn):
    """(decayed, not decayed) names of transformer layer i with the given FFN parameters."""
    decay = [f"layers.{i}.attention.qkv.weight", f"layers.{i}.attention.proj.weight"]
    no_decay = [f"layers.{i}.attention_norm.weight", f"layers.{i}.attention_norm.bias",
                f"layers.{i}.attention.qkv.bias", f"layers.{i}.attention.proj.bias",
                f"layers.{i}.ffn_norm.weight", f"layers.{i}.ffn_norm.bias"]
    return decay + [f"layers.{i}.ffn.{n}" for n in ffn[0]], no_decay + [f"layers.{i}.ffn.{n}" for n in ffn[1]]


DENSE_FFN = (["fc1.weight", "fc2.weight"], ["fc1.bias", "fc2.bias"])
MOE_FFN = (["router.weight", "experts.w1", "experts.w2"], ["experts.b1", "experts.b2"])  # b1 [E, W], b2 [E, h]
LAYERS = [_layer_names(0, DENSE_FFN), _layer_names(1, MOE_FFN)]
# Megatron-LM's rule: word/position/token-type embeddings and output weights decay; biases and norms do not
GPT = ({"embedding.word.weight", "embedding.position", "output.weight"}, {"final_norm.weight", "final_norm.bias"})
BERT = ({"embedding.word.weight", "embedding.position", "embedding.token_type", "mlm_dense.weight",
         "pooler.weight", "binary_head.weight"},
        {"final_norm.weight", "final_norm.bias", "mlm_dense.bias", "mlm_norm.weight", "mlm_norm.bias",
         "mlm_bias", "pooler.bias", "binary_head.bias"})


def _names(model, params):
    ids = {id(p) for p in params}
    return {n for n, p in model.named_parameters() if id(p) in ids}


@pytest.mark.parametrize("model_cls,extra", [(GPTMoEModel, GPT), (BertMoEModel, BERT)], ids=["gpt", "bert"])
def test_decay_groups_by_role(model_cls, extra):
    model = model_cls(_config(), SINGLE)
    decay, no_decay = param_groups(model, 0.1)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    expected_decay = extra[0] | {n for d, _ in LAYERS for n in d}
    expected_no_decay = extra[1] | {n for _, nd in LAYERS for n in nd}
    assert _names(model, decay["params"]) == expected_decay
    assert _names(model, no_decay["params"]) == expected_no_decay
    assert expected_decay | expected_no_decay == {n for n, _ in model.named_parameters()}


def test_adamw_step_with_zero_gradients_decays_weights_only():
    model = GPTMoEModel(_config(), SINGLE)
    lr, wd = 0.1, 0.5
    optimizer = build_optimizer(model, OptimizerConfig(lr=lr, weight_decay=wd))
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():  # non-zero everywhere (biases start at 0, norm scales at 1)
        p.data.copy_(torch.randn(p.shape, generator=gen))
        p.grad = torch.zeros_like(p)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer.step()
    decayed = GPT[0] | {n for d, _ in LAYERS for n in d}
    for name, p in model.named_parameters():
        expected = before[name] * (1 - lr * wd) if name in decayed else before[name]
        same = torch.equal(p.detach(), expected)
        assert same, f"{name}: {'not decayed by exactly (1 - lr*wd)' if name in decayed else 'changed'}"
