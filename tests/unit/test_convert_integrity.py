"""Checkpoint conversion never produces a wrong model silently (issue #42, items 1-4;
tools/convert_checkpoint.py, docs/checkpoints.md "Conversions").

On a tiny random Qwen2-MoE (q/k/v biases, a gated shared expert, 4 experts) saved by `transformers`:
1. import-hf into a root that holds a checkpoint: refused in one line (exit 2) naming --force;
   with --force the new model (its kv groups, norm_topk_prob, logits) replaces the old one.
2. export-hf into someone else's non-empty directory: refused, replaced whole with --force;
   over an earlier export of ours it replaces it without --force, no stale shard left. import-hf
   reads the shards model.safetensors.index.json lists, not a stale one beside them.
3. A tensor the model does not use (o_proj.bias, experts.4.* of 4 experts): refused by name;
   --allow-unused lists it and imports the same weights.
4. A config.json without a key the family needs, a truncated safetensors file, a missing tensor:
   one line, exit 2, naming the file and the key / tensor as HF names it (subprocess: no traceback).
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_moe import load_model
from megatron_moe.convert import offline
from megatron_moe.convert.hf_common import INDEX
from tests.checkpoint_helpers import hf_tensors, random_hf_model
from tools.convert_checkpoint import main

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402  (after transformers: its dependency)

ROOT = Path(__file__).resolve().parents[2]
TOKENS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))
QWEN2 = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
             rms_norm_eps=1e-6, num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16,
             shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
             decoder_sparse_step=1)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """(HF directory, our import of it)."""
    tmp = tmp_path_factory.mktemp("qwen2")
    random_hf_model("Qwen2MoeConfig", "Qwen2MoeForCausalLM", QWEN2, tmp / "hf")
    offline.import_hf(str(tmp / "hf"), str(tmp / "ours"))
    return tmp / "hf", tmp / "ours"


def _cli(*args):
    return subprocess.run([sys.executable, "tools/convert_checkpoint.py"] + [str(a) for a in args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def _one_line(rc, stderr, *fragments):
    assert rc == 2 and "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, (rc, stderr)
    assert all(f in stderr for f in fragments), (fragments, stderr)


def _main(capsys, *args):
    capsys.readouterr()  # what came before (transformers' progress bars)
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.err, out.out


def _weights(root):
    return offline.model_weights(str(root))[1]


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_import_into_a_checkpoint_root_refuses_or_replaces_with_force(qwen2, tmp_path, capsys):
    hf, _ = qwen2
    other = random_hf_model("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                            dict(QWEN2, num_key_value_heads=2, norm_topk_prob=True), tmp_path / "other")
    root = tmp_path / "ours"
    offline.import_hf(str(hf), str(root))
    old = _weights(root)
    rc, err, out = _main(capsys, "import-hf", "--input", tmp_path / "other", "--output", root)
    _one_line(rc, err, f"--output {root} already holds a checkpoint (iter_0000000, latest)", "pass --force")
    assert not out and _same(_weights(root), old)  # no "wrote", the old model kept as it was
    rc, err, out = _main(capsys, "import-hf", "--input", tmp_path / "other", "--output", root, "--force")
    assert rc == 0 and out.strip() == f"wrote {root}/iter_0000000", err
    new = load_model(str(root))
    assert new.cfg.model.num_query_groups == 2 and new.cfg.moe.norm_topk_prob is True
    with torch.no_grad():
        assert (new(TOKENS) - other(TOKENS).logits).abs().max().item() < 1e-4
    assert sorted(os.listdir(root)) == ["iter_0000000", "latest"]
    assert sorted(os.listdir(tmp_path)) == ["other", "ours"]  # the swap left nothing beside it


def test_export_into_a_non_empty_directory(qwen2, tmp_path, capsys):
    _, ours = qwen2
    out = tmp_path / "hf"
    out.mkdir()
    for k in range(1, 4):  # someone else's directory: older shards and a README
        save_file({"stale": torch.zeros(2)}, str(out / f"model-0000{k}-of-00003.safetensors"))
    (out / "README.md").write_text("mine")
    rc, err, _ = _main(capsys, "export-hf", "--input", ours, "--output", out)
    _one_line(rc, err, f"--output {out} already holds files (README.md, model-00001-of-00003.safetensors, "
                       "model-00002-of-00003.safetensors and 1 more); pass --force to replace it")
    assert (out / "README.md").read_text() == "mine"
    rc, err, _ = _main(capsys, "export-hf", "--input", ours, "--output", out, "--force")
    assert rc == 0, err
    assert sorted(os.listdir(out)) == ["config.json", "model-00001-of-00001.safetensors", INDEX]
    # an earlier export of ours (7 shards) is replaced without --force by one of 1 shard: no stale shard
    offline.export_hf(str(ours), str(out), max_shard_bytes=16 << 10)
    many = set(json.loads((out / INDEX).read_text())["weight_map"].values())
    assert len(many) > 3 and set(os.listdir(out)) == many | {"config.json", INDEX}
    offline.export_hf(str(ours), str(out))
    assert sorted(os.listdir(out)) == ["config.json", "model-00001-of-00001.safetensors", INDEX]
    assert sorted(os.listdir(tmp_path)) == ["hf"]
    # an output that contains the input is refused even with --force (it would delete the input)
    rc, err, _ = _main(capsys, "export-hf", "--input", ours, "--output", ours.parent, "--force")
    _one_line(rc, err, f"--output {ours.parent} overlaps --input {ours}")


def test_import_follows_the_index_not_the_directory(qwen2, tmp_path):
    hf, ours = qwen2
    out = tmp_path / "hf"
    offline.export_hf(str(ours), str(out), max_shard_bytes=16 << 10)
    exported = hf_tensors(out)
    # a stale shard the index does not list, holding every tensor with other values (sorted last)
    save_file({k: v + 1 for k, v in exported.items()}, str(out / "model-99999-of-99999.safetensors"))
    offline.import_hf(str(out), str(tmp_path / "back"))
    assert _same(_weights(tmp_path / "back"), _weights(ours))
    with torch.no_grad():
        assert torch.equal(load_model(str(tmp_path / "back"))(TOKENS), load_model(str(ours))(TOKENS))


def test_unused_tensors_are_refused_or_listed_with_allow_unused(qwen2, tmp_path, capsys):
    hf, ours = qwen2
    shutil.copytree(hf, tmp_path / "hf")
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    extra = {"model.layers.0.self_attn.o_proj.bias": torch.ones(32),  # Qwen2-MoE's o_proj has no bias
             "model.layers.1.mlp.experts.4.gate_proj.weight": torch.ones(16, 32)}  # num_experts is 4
    save_file(dict(tensors, **extra), str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    names = ", ".join(sorted(extra))
    rc, err, out = _main(capsys, "import-hf", "--input", tmp_path / "hf", "--output", tmp_path / "ours")
    _one_line(rc, err, f"has 2 tensors the model does not use: {names}; pass --allow-unused")
    assert not out and not (tmp_path / "ours").exists()
    rc, err, out = _main(capsys, "import-hf", "--input", tmp_path / "hf", "--output", tmp_path / "ours",
                         "--allow-unused")
    assert rc == 0 and err.strip() == f"warning: skipping 2 tensors the model does not use: {names}", err
    assert _same(_weights(tmp_path / "ours"), _weights(ours))


@pytest.fixture
def broken(qwen2, tmp_path):
    shutil.copytree(qwen2[0], tmp_path / "hf")
    return tmp_path / "hf"


def _drop_config_key(hf, key):
    config = json.loads((hf / "config.json").read_text())
    config.pop(key)
    (hf / "config.json").write_text(json.dumps(config))


def test_missing_config_key_is_one_line_naming_file_and_key(broken, tmp_path):
    """`num_experts` (Qwen2-MoE's name for it), not the alias `num_local_experts`: through the CLI."""
    _drop_config_key(broken, "num_experts")
    proc = _cli("import-hf", "--input", broken, "--output", tmp_path / "ours")
    _one_line(proc.returncode, proc.stderr,
              f"error: {broken}/config.json has no 'num_experts', which a qwen2_moe config needs")
    assert "num_local_experts" not in proc.stderr and not (tmp_path / "ours").exists()


@pytest.mark.parametrize("key", ["num_experts_per_tok", "moe_intermediate_size", "hidden_size",
                                 "shared_expert_intermediate_size"])
def test_each_missing_config_key_is_named(broken, tmp_path, capsys, key):
    _drop_config_key(broken, key)
    rc, err, _ = _main(capsys, "import-hf", "--input", broken, "--output", tmp_path / "ours")
    _one_line(rc, err, f"error: {broken}/config.json has no {key!r}")


def test_truncated_safetensors_is_one_line_naming_the_file(broken, tmp_path):
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[:len(data) // 2])
    proc = _cli("import-hf", "--input", broken, "--output", tmp_path / "ours")
    _one_line(proc.returncode, proc.stderr, f"error: {broken}/model.safetensors is not a readable safetensors file")


def test_missing_tensor_is_named_as_hf_names_it(broken, tmp_path):
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.0.self_attn.q_proj.bias"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    proc = _cli("import-hf", "--input", broken, "--output", tmp_path / "ours")
    _one_line(proc.returncode, proc.stderr, f"error: {broken} has no tensor model.layers.0.self_attn.q_proj.bias")


def test_a_stored_copy_of_the_tied_embedding_counts_as_used(broken, tmp_path):
    """tie_word_embeddings with lm_head.weight stored too: equal to the embedding -> imported;
    different -> refused by name (the tied model would not use it)."""
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps(dict(config, tie_word_embeddings=True)))
    tensors = load_file(str(broken / "model.safetensors"))
    save_file(dict(tensors, **{"lm_head.weight": tensors["model.embed_tokens.weight"].clone()}),
              str(broken / "model.safetensors"), metadata={"format": "pt"})
    offline.import_hf(str(broken), str(tmp_path / "tied"))
    assert "output.weight" not in _weights(tmp_path / "tied")
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})  # lm_head differs
    with pytest.raises(ValueError, match="has 1 tensor the model does not use: lm_head.weight;"):
        offline.import_hf(str(broken), str(tmp_path / "untied"))
