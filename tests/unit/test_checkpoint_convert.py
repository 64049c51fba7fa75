"""tools/convert_checkpoint.py (issue 4 §5): Hugging Face Mixtral export (logits match
transformers) and import (round trip bit-identical), sparse upcycling (MoE output = dense output
at step 0), offline resharding and consolidation (same model, target-layout chunks)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_moe import load_model
from megatron_moe.convert import offline
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.training.checkpoint_io import read_metadata
from megatron_moe.training.trainer import Trainer
from tests.checkpoint_helpers import mixtral_config, synthetic_datasets
from tests.unit.test_checkpoint import train

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["training.train_iters=2", "training.micro_batch_size=2", "training.global_batch_size=4",
         "model.seq_length=16", "training.eval_interval=0", "checkpoint.save_interval=2", "model.vocab_size=96"]
TOKENS = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def mixtral_ckpt(tmp_path_factory):
    """A trained (2 iterations) Mixtral-shaped checkpoint."""
    tmp = tmp_path_factory.mktemp("mixtral")
    Trainer(mixtral_config(tmp, SHORT), ParallelState.single_process(), datasets=synthetic_datasets).train()
    return str(tmp / "ckpt")


def test_export_hf_matches_transformers_and_round_trips(mixtral_ckpt, tmp_path):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    offline.export_hf(mixtral_ckpt, str(tmp_path / "hf"))
    hf = transformers.MixtralForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    ours = load_model(mixtral_ckpt)
    with torch.no_grad():
        diff = (hf(TOKENS).logits - ours(TOKENS)).abs().max().item()
    assert diff < 1e-4, diff
    # import -> export is bit-identical; the imported checkpoint is the same model
    offline.import_hf(str(tmp_path / "hf"), str(tmp_path / "imported"))
    offline.export_hf(str(tmp_path / "imported"), str(tmp_path / "hf2"))
    first, second = (load_file(str(tmp_path / d / "model-00001-of-00001.safetensors")) for d in ("hf", "hf2"))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == \
        json.loads((tmp_path / "hf2" / "config.json").read_text())
    with torch.no_grad():
        assert torch.equal(load_model(str(tmp_path / "imported"))(TOKENS), ours(TOKENS))


def test_export_hf_writes_the_dtype_asked_for(mixtral_ckpt, tmp_path):
    """`export-hf --precision bf16`: bf16 tensors, the fp32 checkpoint's weights rounded once, and
    config.json saying so; fp32 stays the default of an fp32 run."""
    from safetensors.torch import load_file

    proc = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "export-hf", "--input", mixtral_ckpt,
                           "--output", str(tmp_path / "bf16"), "--precision", "bf16"], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    offline.export_hf(mixtral_ckpt, str(tmp_path / "fp32"))
    bf16, fp32 = (load_file(str(tmp_path / d / "model-00001-of-00001.safetensors")) for d in ("bf16", "fp32"))
    assert {t.dtype for t in bf16.values()} == {torch.bfloat16} and {t.dtype for t in fp32.values()} == {torch.float32}
    assert all(torch.equal(bf16[k], fp32[k].bfloat16()) for k in fp32)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert json.loads((tmp_path / "fp32" / "config.json").read_text())["torch_dtype"] == "float32"


def test_export_hf_refuses_non_mixtral_naming_the_option(tmp_path):
    train(tmp_path, ["training.train_iters=1", "checkpoint.save_interval=1"])  # gpt_moe_tiny: layernorm, gelu, ...
    proc = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "export-hf", "--input",
                           str(tmp_path / "ckpt"), "--output", str(tmp_path / "hf")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: not MixtralForCausalLM-shaped: model.normalization=layernorm "
                                   "(MixtralForCausalLM uses rmsnorm)")


def test_upcycled_moe_equals_dense_model(tmp_path):
    # dense GPT (no MoE layer: layer_freq > num_layers) with biases, trained 1 step so they are non-zero
    train(tmp_path, ["training.train_iters=1", "checkpoint.save_interval=1", "moe.layer_freq=3"])
    offline.upcycle(str(tmp_path / "ckpt"), 4, str(tmp_path / "moe"))
    dense, moe = load_model(str(tmp_path / "ckpt")), load_model(str(tmp_path / "moe"))
    assert not dense.model.moe_layers() and len(moe.model.moe_layers()) == 2 and moe.cfg.moe.top_k == 2
    tokens = TOKENS % 128
    with torch.no_grad():
        torch.testing.assert_close(moe(tokens), dense(tokens), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="layer 0 is already MoE"):
        offline.upcycle(str(tmp_path / "moe"), 4, str(tmp_path / "again"))


def test_reshard_and_consolidate(mixtral_ckpt, tmp_path):
    from safetensors import safe_open

    out = offline.reshard(mixtral_ckpt, str(tmp_path / "t2e2s2"), tensor=2, expert=2, expert_shard=2)
    md = read_metadata(out).state_dict_metadata
    assert len(md["model/layers.0.ffn.experts.w1"].chunks) == 4  # ep x esp
    assert len(md["optim/layers.0.attention.qkv.weight/exp_avg"].chunks) == 2  # tp
    assert len(md["model/final_norm.weight"].chunks) == 1  # replicated: saved once
    assert not [k for k in md if k.startswith("rng/")]
    with torch.no_grad():
        assert torch.equal(load_model(out)(TOKENS), load_model(mixtral_ckpt)(TOKENS))
    offline.consolidate(mixtral_ckpt, str(tmp_path / "all.safetensors"))
    _, _, full = offline.read_checkpoint(mixtral_ckpt)
    with safe_open(str(tmp_path / "all.safetensors"), "pt") as f:
        assert set(f.keys()) == {k for k in full if not k.startswith("rng/")}
        assert torch.equal(f.get_tensor("optim/layers.1.ffn.experts.w2/exp_avg_sq"),
                           full["optim/layers.1.ffn.experts.w2/exp_avg_sq"])
        assert json.loads(f.metadata()["meta"])["iteration"] == 2


def _interleave(new: torch.Tensor, k: int) -> torch.Tensor:
    """The halves layout's dims (k: 2, k + 1: f) back to the old interleaved 2f (gate/up per unit)."""
    return new.transpose(k, k + 1).flatten(k, k + 1).contiguous()


def test_upgrade_swiglu_converts_interleaved_checkpoints(tmp_path):
    """Checkpoints written before the SwiGLU halves layout (issue #16) are refused with the fix in
    one line, and `upgrade-swiglu` turns them into the same model and optimizer state."""
    from megatron_moe.training.checkpoint import write_checkpoint_dir
    from megatron_moe.training.checkpoint_files import full_entry
    from megatron_moe.training.failures import CheckpointError

    # dense SwiGLU fc1 (layer 0) and expert w1 / b1 (layer 1), with biases and AdamW moments
    cfg = mixtral_config(tmp_path, SHORT + ["moe.layer_freq=2", "model.bias=true"])
    Trainer(cfg, ParallelState.single_process(), datasets=synthetic_datasets).train()
    path, meta, tensors = offline.read_checkpoint(str(tmp_path / "ckpt"))
    old = {}
    for key, t in tensors.items():
        k = {"layers.0.ffn.fc1.weight": 0, "layers.0.ffn.fc1.bias": 0, "layers.1.ffn.experts.w1": 2,
             "layers.1.ffn.experts.b1": 1}.get(offline._param_of(key)) if not key.endswith("/step") else None
        old[key] = _interleave(t, k) if k is not None else t
    assert sum(not torch.equal(old[k], tensors[k]) for k in old if k.startswith("model/")) == 4
    old_dir = write_checkpoint_dir(str(tmp_path / "old"), meta["iteration"],
                                   {k: full_entry(v) for k, v in old.items() if not k.startswith("rng/")},
                                   meta, (Path(path) / "config.yaml").read_text(), None)
    with pytest.raises(CheckpointError, match="old interleaved layout; convert it: python tools/convert_checkpoint.py "
                                              "upgrade-swiglu"):
        load_model(old_dir)
    proc = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "upgrade-swiglu", "--input", old_dir,
                           "--output", str(tmp_path / "new")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    upgraded, upgraded_meta, new = offline.read_checkpoint(str(tmp_path / "new"))
    assert upgraded_meta["iteration"] == meta["iteration"]
    assert {k for k in new} == {k for k in tensors if not k.startswith("rng/")}
    assert all(torch.equal(new[k], tensors[k]) for k in new), "weights and AdamW moments restored exactly"
    with torch.no_grad():
        assert torch.equal(load_model(upgraded)(TOKENS[:, :8]), load_model(path)(TOKENS[:, :8]))
    with pytest.raises(ValueError, match="nothing to upgrade"):
        offline.upgrade_swiglu(upgraded, str(tmp_path / "again"))
