"""Hugging Face export from real distributed checkpoints, and the expert bias across layouts (#31).

One spawn of 4 gloo processes trains, on the synthetic tokens, for 3 iterations each:

* one model of each of the four families: Qwen3-MoE-shaped (GQA 8 heads / 2 kv heads, head_dim
  apart from hidden / heads, per-head QK-norm, norm_topk_prob), Qwen2-MoE-shaped (q/k/v biases, a
  shared expert with its sigmoid gate, raw top-k probabilities; every other layer dense on tensor
  2), Mixtral-shaped (GQA 8 heads / 2 kv heads, top-2 renormalized) and OLMoE-shaped (MHA, QK-norm
  over the whole q / k projection, raw top-k probabilities), each at tensor 2 x expert 2 and again
  at pipeline 2 x expert 2 with vExpert slots (FlexMoE or EPLB) that moved experts after every
  step; each saves a checkpoint. In this process each checkpoint is exported
  with `offline.export_hf` (tools/convert_checkpoint.py export-hf) and `from_pretrained` of the
  family's class gives the logits of the checkpoint's single-process model (`load_model`) within
  1e-4 (fp32); the tensor-2 x expert-2 checkpoint, loaded by a 1-process Trainer and saved again,
  exports the same tensors bit for bit.
* the DeepSeek-style routing config (sigmoid scores, group-limited top-k, shared expert, no aux
  loss) with `moe.expert_bias` at expert 2 (data parallel 4), tensor 2 x expert 2, pipeline 2 x
  expert 2, and expert 4 on 2 nodes of 2 ranks with EPLB's hierarchical plan re-packing the 4 router
  groups onto the nodes after every step: every rank's expert biases after 3 updates equal the
  1-process run's (rel 1e-5), as do the losses; EPLB moved experts, and every group's experts
  (replicas included) sit on one node.
"""
import json

import pytest
import torch

from megatron_moe import load_model
from megatron_moe.config import load_config
from megatron_moe.convert import offline
from megatron_moe.distributed.parallel_state import ParallelState, RankLayout
from megatron_moe.training.trainer import Trainer
from tests.checkpoint_helpers import cheap_moves_profile, hf_tensors, synthetic_datasets
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.distributed
transformers = pytest.importorskip("transformers")

COMMON = ["training.train_iters=3", "training.log_interval=1", "training.eval_interval=0", "model.seq_length=16",
          "training.micro_batch_size=2", "training.global_batch_size=8", "model.vocab_size=125",  # odd: padded under tp=2
          "logging.tensorboard=false", "optimizer.warmup_iters=1", "checkpoint.load=null", "checkpoint.keep_last=0",
          "moe.num_experts=8"]
QWEN3 = ("configs/qwen3_moe_tiny.yaml", [])
QWEN2 = ("configs/qwen3_moe_tiny.yaml", ["model.qk_norm=none", "model.head_dim=null", "model.qkv_bias=true",
                                         "model.num_query_groups=4", "moe.norm_topk_prob=false",
                                         "moe.shared_expert_ffn_hidden_size=48", "moe.shared_expert_gate=true"])
# Mixtral-8x7B: 4 query heads per key/value head (8 heads, 2 kv here), top-2 renormalized
MIXTRAL = ("configs/mixtral_tiny.yaml", ["model.num_attention_heads=8", "model.num_query_groups=2",
                                         "moe.expert_ffn_hidden_size=32"])
# OLMoE-1B-7B: MHA, RMSNorm of the whole q / k projection, raw top-k probabilities
OLMOE = ("configs/qwen3_moe_tiny.yaml", ["model.qk_norm=full", "model.head_dim=null", "model.num_query_groups=null",
                                         "moe.norm_topk_prob=false"])
KV_HEADS = {"qwen3_moe": 2, "qwen2_moe": 4, "mixtral": 2, "olmoe": 8}
TP2_EP2 = dict(tensor=2, expert=2)
PP2_EP2 = dict(pipeline=2, expert=2)
FLEXMOE = ["moe.balancer=flexmoe", "moe.flexmoe.interval=1", "moe.flexmoe.threshold=1.0"]  # + cheap moves
EPLB = ["moe.balancer=eplb", "moe.eplb.interval=1"]
EXPORTS = {  # name: (family, config, extra overrides, layout)
    "qwen3_moe-tp2ep2": ("qwen3_moe", QWEN3, [], TP2_EP2),
    "qwen2_moe-tp2ep2": ("qwen2_moe", QWEN2, ["moe.layer_freq=2"], TP2_EP2),  # layer 0 a dense SwiGLU MLP
    "qwen3_moe-pp2ep2-flexmoe": ("qwen3_moe", QWEN3, FLEXMOE, PP2_EP2),
    "qwen2_moe-pp2ep2-eplb": ("qwen2_moe", QWEN2, EPLB, PP2_EP2),
    "mixtral-tp2ep2": ("mixtral", MIXTRAL, [], TP2_EP2),
    "mixtral-pp2ep2-eplb": ("mixtral", MIXTRAL, EPLB, PP2_EP2),
    "olmoe-tp2ep2": ("olmoe", OLMOE, [], TP2_EP2),  # full QK-norm over q / k split across tensor ranks
    "olmoe-pp2ep2-flexmoe": ("olmoe", OLMOE, FLEXMOE, PP2_EP2),
}
BIAS = ["model.num_layers=2", "moe.expert_bias_rate=0.01", "moe.num_experts=16"]
BIAS_LAYOUTS = {"ep2": dict(expert=2), "tp2ep2": TP2_EP2, "pp2ep2": PP2_EP2,
                "ep4-eplb-nodes": dict(expert=4, ranks_per_node=2)}  # 2 nodes of 2 EP ranks
# EPLB's hierarchical plan packs the router's 4 groups onto the 2 nodes, re-planned after every step
# (hierarchical: true; `auto` plans globally here: a token's 2 groups may span both nodes anyway)
BIAS_EXTRA = {"ep4-eplb-nodes": EPLB + ["moe.eplb.hierarchical=true"]}


def _config(tmp, name, path, overrides, layout):
    par = [f"parallel.{k}={v}" for k, v in layout.items()]
    return load_config(path, COMMON + list(overrides) + par + [f"training.run_dir={tmp}/{name}/run",
                                                              f"checkpoint.dir={tmp}/{name}/ckpt"])


def _export_config(tmp, name, layout=None):
    _, (path, base), extra, saved_layout = EXPORTS[name]
    moves = [f"perf.hardware_profile={tmp}/cheap_moves.yaml"] if extra == FLEXMOE else []
    return _config(tmp, name, path, base + extra + moves + ["checkpoint.save_interval=3"],
                   saved_layout if layout is None else layout)


def _bias_config(tmp, name):
    return _config(tmp, "bias-" + name, "configs/deepseek_routing_tiny.yaml", BIAS + BIAS_EXTRA.get(name, []),
                   BIAS_LAYOUTS.get(name, {}))


def _biases(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if n.endswith("router.expert_bias")}


def _train_all(state, tmp):
    """Every job of this world on this rank: checkpoints on disk; vExpert moves, losses, biases back."""
    out = {}
    for name in EXPORTS:
        layout = EXPORTS[name][3]
        sub = ParallelState.build(RankLayout(world_size=state.world_size, **layout), state.rank)
        records = Trainer(_export_config(tmp, name), sub, datasets=synthetic_datasets).train()
        out[name] = dict(moves=[sum(r.get("vexpert_moves", [])) for r in records])
    for name, layout in BIAS_LAYOUTS.items():
        sub = ParallelState.build(RankLayout(world_size=state.world_size, **layout), state.rank)
        trainer = Trainer(_bias_config(tmp, name), sub, datasets=synthetic_datasets)
        records = trainer.train()
        out["bias-" + name] = dict(losses=[r["loss"] for r in records], biases=_biases(trainer),
                                   moves=[sum(r.get("vexpert_moves", [])) for r in records],
                                   slots=[layer.balancer.table.slots.copy() for layer in trainer.model.moe_layers()
                                          if getattr(layer.balancer, "table", None) is not None])
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_export")
    cheap_moves_profile(tmp)
    return str(tmp), run_distributed(4, _train_all, args=(str(tmp),), timeout=600)


TOKENS = torch.randint(0, 125, (2, 16), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_from_a_distributed_checkpoint(trained, name, tmp_path):
    tmp, ranks = trained
    family, _, _, layout = EXPORTS[name]
    if "pipeline" in layout:  # the vExpert slots moved experts after every step
        assert all(m > 0 for m in ranks[0][name]["moves"]), ranks[0][name]["moves"]
    ckpt = f"{tmp}/{name}/ckpt"
    offline.export_hf(ckpt, str(tmp_path / "hf"), max_shard_bytes=64 << 10)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == family and config["num_key_value_heads"] == KV_HEADS[family]
    hf = getattr(transformers, config["architectures"][0]).from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    with torch.no_grad():
        ours = load_model(ckpt)(TOKENS)
        theirs = hf.eval()(TOKENS).logits
    assert ours.shape == theirs.shape == (2, 16, 125)
    assert (ours - theirs).abs().max().item() < 1e-4, name
    if "tensor" not in layout:
        return
    # the same checkpoint loaded by 1 process and saved there exports the same tensors bit for bit
    cfg = _export_config(tmp, name, layout={})
    cfg.checkpoint.load, cfg.checkpoint.dir = ckpt, str(tmp_path / "single")
    trainer = Trainer(cfg, ParallelState.single_process(), datasets=synthetic_datasets)
    single = trainer.save_checkpoint(trainer.load_checkpoint())
    offline.export_hf(single, str(tmp_path / "hf_single"))
    exported, again = hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "hf_single")
    assert exported.keys() == again.keys() and all(torch.equal(exported[k], again[k]) for k in exported)
    assert any(k.endswith(("q_norm.weight", "shared_expert_gate.weight", "block_sparse_moe.gate.weight")) for k in exported)


def test_expert_bias_is_exact_across_layouts(trained, tmp_path):
    tmp, ranks = trained
    ref = Trainer(_bias_config(str(tmp_path), "single"), ParallelState.single_process(), datasets=synthetic_datasets)
    ref_losses = [r["loss"] for r in ref.train()]
    ref_biases = _biases(ref)
    assert len(ref_biases) == 2 and all(b.abs().sum() > 0 and b.unique().numel() > 1 for b in ref_biases.values())
    for name in BIAS_LAYOUTS:
        held = set()
        for rank, out in enumerate(ranks):
            got = out["bias-" + name]
            assert got["losses"] == pytest.approx(ref_losses, rel=1e-5), (name, rank)
            for param, bias in got["biases"].items():
                torch.testing.assert_close(bias, ref_biases[param], rtol=1e-5, atol=0, msg=f"{name} rank {rank} {param}")
                held.add(param)
        assert held == set(ref_biases), name  # every layer's bias is checked (pipeline: on its stage)
    eplb = ranks[0]["bias-ep4-eplb-nodes"]
    assert all(m > 0 for m in eplb["moves"]) and len(eplb["slots"]) == 2, eplb["moves"]
    for slots in eplb["slots"]:  # [4 EP ranks, 5 slots]: every expert of a router group on one node
        node_of = {}
        for q, row in enumerate(slots.tolist()):
            for e in row:
                assert node_of.setdefault(e // 4, q // 2) == q // 2, slots  # group of expert e: e // (16 / 4)
        assert len(node_of) == 4
