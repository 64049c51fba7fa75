"""Multi-token prediction (model/mtp.py, DeepSeek-V3 §2.2) and dense / MoE layers by position
(`moe.first_k_dense`, `moe.layer_pattern`) on one process: the MTP loss and its gradients against a
straightforward reference (each depth on the truncated sequence that has labels, plain tensor ops,
the paper's concatenation with M_k's column blocks swapped), parameter names and shapes, the layer
flags, the trainer's `mtp_loss` record and console line (the LM loss unchanged), the validation
errors, and checkpoints with MTP resharded and loaded back."""
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from megatron_moe import load_model
from megatron_moe.config import load_config, validate_config
from megatron_moe.config.errors import ConfigError
from megatron_moe.config.schema import Config
from megatron_moe.convert import offline
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.gpt import GPTMoEModel
from megatron_moe.training.metrics import format_console, scalars
from megatron_moe.training.trainer import Trainer
from tests.checkpoint_helpers import mixtral_config, synthetic_datasets

TOL = dict(rtol=1e-5, atol=1e-6)
SINGLE = ParallelState.single_process()
B, S, V, H = 2, 10, 50, 32


def _config(depth=2, **moe):
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads = 3, H, 48, 4
    m.seq_length, m.vocab_size, m.dropout, m.mtp_depth = S, V, 0.0, depth
    m.normalization, m.activation, m.position_embedding, m.bias, m.tie_embeddings = "rmsnorm", "swiglu", "rope", False, False
    cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.expert_ffn_hidden_size, cfg.moe.first_k_dense = 4, 2, 24, 1
    for key, value in moe.items():
        setattr(cfg.moe, key, value)
    validate_config(cfg, 1)
    return cfg


def _batch():
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, V, (B, S + 1), generator=gen)
    loss_mask = (torch.rand(B, S, generator=gen) > 0.25).float()
    return tokens[:, :-1], tokens[:, 1:], loss_mask


def _rms(x, weight, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _reference_mtp_loss(model, tokens, labels, loss_mask):
    """1/D Σ_k L_k written out: depth k keeps the s - k positions i that have a label t_{i+k+1}."""
    x = model.embedding(tokens)
    for layer in model.layers:
        x, _ = layer(x)
    h = model.final_norm(x)  # h_0: the output head's input
    emb, out = model.embedding.word.weight[:V], model.output.weight[:V]
    losses = []
    for k, depth in enumerate(model.mtp, start=1):
        n = S - k
        e = _rms(emb[tokens[:, k:]], depth.enorm.weight)  # Emb(t_{i+k}) [b, n, h]
        hp = _rms(h[:, :n], depth.hnorm.weight)
        m_k = depth.eh_proj.weight  # [h, 2h]: columns [emb | hidden] (checkpoint order)
        paper = torch.cat([m_k[:, H:], m_k[:, :H]], dim=1)  # the paper's M_k for [h; emb]
        x, _ = depth.layer(torch.cat([hp, e], dim=-1) @ paper.T)  # causal: the truncated sequence suffices
        h = _rms(x, depth.final_norm.weight)
        ce = F.cross_entropy((h @ out.T).reshape(-1, V), labels[:, k:].reshape(-1), reduction="none").view(B, n)
        mask = loss_mask[:, k:]
        losses.append((ce * mask).sum() / mask.sum())
    return sum(losses) / len(losses)


def test_mtp_loss_and_gradients_match_reference():
    cfg = _config()
    model = GPTMoEModel(cfg, SINGLE)
    tokens, labels, loss_mask = _batch()
    out = model(tokens, labels, loss_mask)
    ref = _reference_mtp_loss(model, tokens, labels, loss_mask)
    assert_close(out.mtp_loss, ref, **TOL)
    grads = []
    for loss in (out.mtp_loss, ref):  # .grad: the experts' dW is added outside autograd
        model.zero_grad(set_to_none=True)
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and "mtp.1.eh_proj.weight" in grads[0]
    for name, g in grads[0].items():
        assert_close(g, grads[1][name], **TOL, msg=name)
    # the MTP layers are MoE (as the last layer): their aux losses and stats join the model's
    assert [layer.layer_index for layer in model.moe_layers()] == [1, 2, 3, 4]
    assert len(out.moe_stats) == 4
    no_mtp = GPTMoEModel(_config(depth=0), SINGLE)(tokens, labels, loss_mask)
    assert torch.equal(out.lm_loss, no_mtp.lm_loss) and no_mtp.mtp_loss is None  # same init by name
    assert out.aux_loss > no_mtp.aux_loss
    assert model.eval()(tokens, labels, loss_mask).mtp_loss is None  # evaluation: the LM loss only


def test_parameter_names_shapes_and_ffn_widths():
    model = GPTMoEModel(_config(depth=1), SINGLE)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["mtp.0.enorm.weight"] == shapes["mtp.0.hnorm.weight"] == shapes["mtp.0.final_norm.weight"] == (H,)
    assert shapes["mtp.0.eh_proj.weight"] == (H, 2 * H)
    mtp_layer = {n[len("mtp.0.layer."):]: s for n, s in shapes.items() if n.startswith("mtp.0.layer.")}
    assert mtp_layer == {n[len("layers.2."):]: s for n, s in shapes.items() if n.startswith("layers.2.")}
    # layer 0 dense (first_k_dense=1): model.ffn_hidden_size; the MoE layers' experts moe.expert_ffn_hidden_size
    assert shapes["layers.0.ffn.fc2.weight"] == (H, 48) and "layers.0.ffn.router.weight" not in shapes
    assert shapes["layers.1.ffn.experts.w2"] == (4, 24, H)


def test_layer_keys_are_validated():
    for overrides, message in [
        (dict(first_k_dense=4), r"^moe.first_k_dense=4 must be in \[0, model.num_layers=3\]$"),
        (dict(first_k_dense=0, layer_pattern=[0, 1]), "^moe.layer_pattern has 2 entries; model.num_layers=3"),
        (dict(first_k_dense=0, layer_pattern=[0, 2, 1]), "^moe.layer_pattern=.* must be a list of 0"),
        (dict(layer_pattern=[0, 1, 1]), "^moe.layer_pattern replaces moe.layer_freq=1 and moe.first_k_dense=1"),
    ]:
        with pytest.raises(ConfigError, match=message):
            _config(**overrides)
    cfg = _config(first_k_dense=0, layer_pattern=[1, 0, 1])
    assert [layer.is_moe for layer in GPTMoEModel(cfg, SINGLE).layers] == [True, False, True]
    for key, value, message in [("model.mtp_depth", 10, r"^model.mtp_depth=10 must be in \[0, model.seq_length=10\)"),
                                ("training.mtp_loss_weight", -0.5, "^training.mtp_loss_weight=-0.5 must be"),
                                ("model.layer_types", ["full_attention"] * 3, "^model.mtp_depth=2 with model.layer_types")]:
        cfg = _config()
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
        cfg.model.sliding_window = 4 if name == "layer_types" else None
        with pytest.raises(ConfigError, match=message):
            validate_config(cfg, 1)


def test_trainer_logs_mtp_loss_and_keeps_the_lm_loss(tmp_path):
    def run(name, extra):
        cfg = mixtral_config(tmp_path / name, ["training.train_iters=2", "training.log_interval=1", "model.seq_length=16",
                                               "training.global_batch_size=4", "training.eval_interval=0",
                                               "moe.first_k_dense=1", "model.vocab_size=96"] + extra)
        return Trainer(cfg, SINGLE, datasets=synthetic_datasets).train()

    plain, mtp = run("plain", []), run("mtp", ["model.mtp_depth=2", "training.mtp_loss_weight=0.3"])
    assert "mtp_loss" not in plain[0] and mtp[0]["mtp_loss"] > 0
    assert mtp[0]["loss"] == plain[0]["loss"]  # before the first update: the same LM loss, MTP apart
    assert mtp[0]["grad_norm"] != plain[0]["grad_norm"]  # the MTP loss is trained
    assert f"| mtp loss {mtp[0]['mtp_loss']:.4f}" in format_console(mtp[0], 2, 0.0)
    assert dict(scalars(mtp[0]))["mtp_loss"] == mtp[0]["mtp_loss"]  # TensorBoard `mtp_loss`


def test_checkpoint_with_mtp_reshards_and_loads(tmp_path):
    cfg = mixtral_config(tmp_path, ["training.train_iters=1", "checkpoint.save_interval=1", "model.seq_length=16",
                                    "training.global_batch_size=2", "training.micro_batch_size=2",
                                    "training.eval_interval=0", "model.mtp_depth=1", "moe.first_k_dense=1"])
    Trainer(cfg, SINGLE, datasets=synthetic_datasets).train()
    original = load_model(str(tmp_path / "ckpt")).model.state_dict()
    assert original["mtp.0.eh_proj.weight"].shape == (64, 128) and "mtp.0.layer.ffn.router.weight" in original
    offline.reshard(str(tmp_path / "ckpt"), str(tmp_path / "tp2ep2"), tensor=2, expert=2, expert_shard=1)
    resharded = load_model(str(tmp_path / "tp2ep2")).model.state_dict()
    assert resharded.keys() == original.keys()
    assert all(torch.equal(resharded[k], original[k]) for k in original)
    fresh = load_config(str(tmp_path / "run" / "config.yaml"), []).training.seed  # not the trained weights
    assert fresh == cfg.training.seed and not torch.equal(
        GPTMoEModel(cfg, SINGLE).state_dict()["mtp.0.eh_proj.weight"], original["mtp.0.eh_proj.weight"])
