"""Tensor-parallel layers, vocab-parallel cross-entropy and the dense GPT on tp=2 and tp=4 against
the same modules built on one process (values, parameter gradients via `meta.local_slices`, input
gradients), including layout-independent initialization and a padded vocabulary; the GPT also with
grouped-query attention (TP splits the query groups) and per-head / full QK-norm, and gpt-oss's
attention (sinks, a sliding window, q/k/v/o biases) and DeepSeek-V3's multi-head latent attention."""
import pytest
import torch
from torch.testing import assert_close

from megatron_moe.config.schema import Config, RopeScalingConfig
from megatron_moe.config.validate import validate_config
from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.gpt import GPTMoEModel
from megatron_moe.tensor_parallel.param_meta import init_model_from_seed_
from megatron_moe.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                          vocab_parallel_cross_entropy)
from tests.distributed.harness import run_distributed

TOL = dict(rtol=1e-5, atol=1e-6)
VOCAB = 251  # padded to 252 on tp=2 and tp=4: the last TP rank holds padding rows

GPT2 = dict(normalization="layernorm", activation="gelu", position_embedding="learned", bias=True, tie_embeddings=True)
MIXTRAL = dict(normalization="rmsnorm", activation="swiglu", position_embedding="rope", bias=False,
               tie_embeddings=False)
# GQA (4 query groups of 2 heads: tp=4 holds one group) with head_dim != h / heads, per-head or full QK-norm
QWEN3 = dict(MIXTRAL, num_attention_heads=8, num_query_groups=4, head_dim=6, qk_norm="head")
OLMOE = dict(MIXTRAL, num_attention_heads=8, num_query_groups=4, qk_norm="full", qkv_bias=True)
# gpt-oss: sinks sharded by head, a sliding window (3 of 8 positions) on layer 0, q/k/v/o biases without model.bias
GPT_OSS = dict(MIXTRAL, num_attention_heads=8, num_query_groups=4, qkv_bias=True, attention_output_bias=True,
               attention_sinks=True, sliding_window=3, layer_types=["sliding_attention", "full_attention"])
# DeepSeek-V3's multi-head latent attention (model/mla.py) with YaRN's mscale: heads split over TP, the
# replicated down projections and their norms whole on every rank (their full gradient, no extra sync)
DEEPSEEK = dict(MIXTRAL, attention="mla", q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4,
                v_head_dim=5, rope_scaling=RopeScalingConfig("yarn", 4.0, 4, mscale=0.9, mscale_all_dim=1.0))
DEEPSEEK_LITE = dict(DEEPSEEK, q_lora_rank=None)  # one query projection, column-parallel
# multi-token prediction (model/mtp.py): eh_proj column-parallel, the shared vocab-parallel head and table
MTP_UNTIED, MTP_TIED = dict(MIXTRAL, mtp_depth=2), dict(GPT2, mtp_depth=1)


def _shard_last(t, state):
    return t.chunk(state.tp_size, dim=-1)[state.tp.rank]


def _local(ref_tensor, p, state):
    """This rank's part of a single-process tensor; `ref_tensor` lacks the zero padding rows that
    `p`'s global shape has (padded vocabulary), so it is zero-padded first."""
    full = ref_tensor.new_zeros(p.meta.global_shape)
    full[: ref_tensor.shape[0]] = ref_tensor
    return full[p.meta.local_slices(state)]


def _check_module(state, make, x_full, shard_input, shard_output):
    """Build `make(state)` and `make(single process)` from one seed; compare init, output, input and
    parameter gradients of sum(y * w) for a fixed random `w`."""
    single = ParallelState.single_process()
    layer, ref = make(state), make(single)
    init_model_from_seed_(layer, 7, state)
    init_model_from_seed_(ref, 7, single)
    for (name, p), r in zip(layer.named_parameters(), ref.parameters()):
        assert torch.equal(p, _local(r, p, state)), name

    floating = x_full.is_floating_point()
    x_ref = x_full.clone().requires_grad_(floating)
    y_ref = ref(x_ref)
    w = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(3))
    (y_ref * w).sum().backward()

    x = shard_input(x_full).clone().requires_grad_(floating)
    y = layer(x)
    assert_close(y, shard_output(y_ref.detach()), **TOL)
    (y * shard_output(w)).sum().backward()
    if floating:
        assert_close(x.grad, shard_input(x_ref.grad), **TOL)
    for (name, p), r in zip(layer.named_parameters(), ref.parameters()):
        assert_close(p.grad, _local(r.grad, p, state), **TOL, msg=name)


def _check_layers(state):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, generator=gen)
    same = lambda t: t  # noqa: E731 - replicated across TP
    shard = lambda t: _shard_last(t, state)  # noqa: E731 - this rank's slice of the last dim
    _check_module(state, lambda s: ColumnParallelLinear(8, 12, s), x, same, shard)
    _check_module(state, lambda s: ColumnParallelLinear(8, 12, s, bias=False, gather_output=True), x, same, same)
    _check_module(state, lambda s: RowParallelLinear(8, 6, s), x, shard, same)
    _check_module(state, lambda s: RowParallelLinear(8, 6, s, input_is_parallel=False), x, same, same)
    tokens = torch.randint(0, 11, (3, 5), generator=gen)
    _check_module(state, lambda s: VocabParallelEmbedding(11, 6, s), tokens, same, same)

    # the row-parallel forward all-reduces exactly its [3, 5, 6] fp32 output over tp
    layer = RowParallelLinear(8, 6, state)
    init_model_from_seed_(layer, 7, state)
    C.COMM_STATS.reset()
    layer(shard(x))
    assert C.COMM_STATS.snapshot() == {"all_reduce/tp": 3 * 5 * 6 * 4}

    # vocab-parallel CE over 11 real + 1 padded entries (12 = 6 per rank on tp=2, 3 on tp=4)
    logits = torch.randn(3, 5, 12, generator=gen) * 3
    labels = torch.randint(0, 11, (3, 5), generator=gen)
    weights = torch.rand(3, 5, generator=gen)
    ref_logits = logits.clone().requires_grad_(True)
    ref_loss = torch.nn.functional.cross_entropy(ref_logits[..., :11].reshape(-1, 11), labels.flatten(),
                                                 reduction="none").view(3, 5)
    (ref_loss * weights).sum().backward()
    local = shard(logits).clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, labels, state.tp, vocab_size=11)
    assert_close(loss, ref_loss.detach(), **TOL)
    (loss * weights).sum().backward()
    assert_close(local.grad, shard(ref_logits.grad), **TOL)


def _gpt_config(flavour, dropout=0.0):
    cfg = Config()
    cfg.model.num_layers, cfg.model.hidden_size, cfg.model.ffn_hidden_size = 2, 32, 64
    cfg.model.num_attention_heads, cfg.model.seq_length, cfg.model.vocab_size = 4, 8, VOCAB
    cfg.model.dropout = dropout
    for key, value in flavour.items():
        setattr(cfg.model, key, value)
    cfg.moe.layer_freq = cfg.model.num_layers + 1  # dense: no MoE layer
    return cfg


def _check_gpt(state, flavour):
    cfg = _gpt_config(flavour)
    validate_config(cfg, 1)
    single = ParallelState.single_process()
    model, ref = GPTMoEModel(cfg, state), GPTMoEModel(cfg, single)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():  # layout-independent init, padded rows zero
        assert torch.equal(p, _local(ref_params[name], p, state)), name
        if p.meta.valid_rows is not None and state.tp.rank == state.tp_size - 1:
            assert p.shape[0] * state.tp_size > VOCAB and not p[-1].any(), name

    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (2, 8), generator=gen)
    labels = torch.randint(0, VOCAB, (2, 8), generator=gen)
    loss_mask = (torch.rand(2, 8, generator=gen) > 0.3).float()
    logits = model(tokens).logits
    assert logits.shape == (2, 8, 252 // state.tp_size)
    assert_close(model.gather_logits(logits), ref(tokens).logits, **TOL)

    out, ref_out = model(tokens, labels, loss_mask), ref(tokens, labels, loss_mask)
    assert out.logits is None and out.aux_loss.item() == 0.0
    assert_close(out.lm_loss, ref_out.lm_loss, **TOL)
    if cfg.model.mtp_depth:
        assert_close(out.mtp_loss, ref_out.mtp_loss, **TOL)
        out.lm_loss, ref_out.lm_loss = out.lm_loss + out.mtp_loss, ref_out.lm_loss + ref_out.mtp_loss
    out.lm_loss.backward()
    ref_out.lm_loss.backward()
    for name, p in model.named_parameters():
        assert_close(p.grad, _local(ref_params[name].grad, p, state), **TOL, msg=name)
    return out.lm_loss.item()


def _replicated_grads_with_dropout(state, flavour=GPT2, prefix=""):
    """With dropout on, TP-replicated parameters must get identical gradients on every TP rank."""
    model = GPTMoEModel(_gpt_config(flavour, dropout=0.2), state).train()
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(9))
    model(tokens, tokens).lm_loss.backward()
    return {prefix + n: p.grad for n, p in model.named_parameters() if not p.meta.shards}


def _check_tensor_parallel(state):
    _check_layers(state)
    losses = [_check_gpt(state, flavour) for flavour in (GPT2, MIXTRAL, QWEN3, OLMOE, GPT_OSS, DEEPSEEK, DEEPSEEK_LITE,
                                                     MTP_UNTIED, MTP_TIED)]
    return losses, {**_replicated_grads_with_dropout(state), **_replicated_grads_with_dropout(state, DEEPSEEK, "mla/")}


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_matches_single_process(tp):
    results = run_distributed(tp, _check_tensor_parallel, dict(tensor=tp))
    losses, grads0 = results[0]
    assert len(set(tuple(r[0]) for r in results)) == 1  # lm_loss identical on every TP rank
    for _, grads in results[1:]:
        for name, g in grads.items():
            assert torch.equal(g, grads0[name]), name
