"""Layout-independent assignment of samples to ranks, and the `data.*` config rules."""
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron_moe.config import ConfigError, load_config
from megatron_moe.data.datasets import validate_data_config
from megatron_moe.data.batches import collate, global_batch, rank_micro_batches
from megatron_moe.data.datasets import build_gpt_datasets_from_config
from megatron_moe.data.indexed import IndexedDatasetBuilder


def test_global_batches_are_consecutive_sample_ranges():
    assert global_batch(0, 4) == [0, 1, 2, 3] and global_batch(3, 4) == [12, 13, 14, 15]


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_micro_batches_are_layout_independent(dp):
    samples = list(range(100, 116))  # a global batch of 16, micro-batch size 2 -> 8 micro-batches
    per_rank = [rank_micro_batches(samples, 2, dp, d) for d in range(dp)]
    assert all(len(r) == 8 // dp for r in per_rank)
    for d, micro in enumerate(per_rank):
        for k, mb in enumerate(micro):
            j = k * dp + d  # global micro-batch index
            assert mb == samples[2 * j: 2 * j + 2]


def _byte_prefix(tmp_path, name="bytes", docs=40):
    """An indexed dataset of `docs` documents of ByteTokenizer ids (vocab 261)."""
    prefix = str(tmp_path / name)
    builder = IndexedDatasetBuilder(prefix, dtype=np.uint16)
    for i in range(docs):
        builder.add_document(list(range(i, i + 30)) + [260], [31])
    builder.finalize()
    return prefix


def test_data_config_rules(tmp_path):
    prefix = _byte_prefix(tmp_path)
    ok = [f"data.path=[{prefix}]", "data.tokenizer.type=ByteTokenizer", "model.vocab_size=261"]
    assert validate_data_config(load_config(None, ok)) == 261
    assert validate_data_config(load_config(None, ["model.vocab_size=4096"])) == 4096  # embedded, default vocab
    bad = [
        (ok[:2] + ["model.vocab_size=100"], "model.vocab_size=100 is smaller than the tokenizer's 261"),
        (["model.vocab_size=1000"], "model.vocab_size=1000 is smaller than the tokenizer's 4096"),
        (ok[:1] + ["model.vocab_size=300"], "data.path needs data.tokenizer.type"),
        (["data.tokenizer.type=ByteTokenizer", "model.vocab_size=9000"], "data.path is null"),
        ([f"data.path=[{prefix}x]"] + ok[1:], "bytesx.idx: file not found"),
        (["data.path=[0.5,a,b]"] + ok[1:], "data.path="),
        ([f"data.path=[{prefix}]", "data.tokenizer.type=GPT2BPETokenizer"], "GPT2BPETokenizer needs a vocab file"),
        (ok + ["data.split=a"], "data.split='a'"),
        (ok + ["data.mask_prob=1.5"], "data.mask_prob=1.5"),
    ]
    for overrides, needle in bad:
        with pytest.raises(ConfigError) as e:
            validate_data_config(load_config(None, overrides))
        assert needle in str(e.value) and "\n" not in str(e.value), (overrides, str(e.value))


def test_data_path_takes_megatrons_data_path_forms(tmp_path):
    """`data.path` as Megatron-LM's `--data-path` takes it (review issue #27 item 5): one prefix
    (the string itself), prefixes, "w1 p1 w2 p2"; as a string or a list, read alike; anything else
    a one-line error naming data.path and the forms."""
    a, b = _byte_prefix(tmp_path, "a"), _byte_prefix(tmp_path, "b", docs=20)
    base = ["data.tokenizer.type=ByteTokenizer", "model.vocab_size=261", "model.seq_length=16", "data.split=90,10,0",
            "training.train_iters=5", "training.global_batch_size=4", "training.eval_iters=2",
            f"data.cache_dir={tmp_path}"]

    def samples(path):
        cfg = load_config(None, base + [f"data.path={path}"])
        assert validate_data_config(cfg) == 261
        train, _ = build_gpt_datasets_from_config(cfg)
        return [train[i]["tokens"].tolist() for i in range(20)]

    one = samples(f"[{a}]")
    assert samples(a) == one  # data.path=/my/corpus_text_document
    assert samples(f"{a} {b}") == samples(f"[{a},{b}]") != one  # two prefixes, blended by their tokens
    weighted = samples(f"[0.3,{a},0.7,{b}]")
    assert samples(f"0.3 {a} 0.7 {b}") == samples(f"['0.3',{a},'0.7',{b}]") == weighted
    assert weighted != samples(f"[0.7,{a},0.3,{b}]")  # the weights are read as weights
    for path, needle in [("{x: 1}", "data.path={'x': 1} must be a prefix, a list of prefixes, or weight/prefix pairs"),
                         ("3", "data.path=3 must be"), (f"[[{a}]]", "must be a prefix"),
                         (f"0.3 {a} {b}", "expected weight, prefix pairs"), ("''", "is empty")]:
        with pytest.raises(ConfigError) as e:
            validate_data_config(load_config(None, base + [f"data.path={path}"]))
        assert needle in str(e.value) and "\n" not in str(e.value), (path, str(e.value))


def test_unknown_tokenizer_type_lists_registered_types():
    from megatron_moe.config import validate_config

    with pytest.raises(ConfigError, match=r"data.tokenizer.type='Nope' is not registered; .*GPT2BPETokenizer"):
        validate_config(load_config(None, ["data.tokenizer.type=Nope"]), 1)


def test_gpt_datasets_from_config(tmp_path):
    prefix = _byte_prefix(tmp_path)
    cfg = load_config(None, [f"data.path=[{prefix}]", "data.tokenizer.type=ByteTokenizer", "model.vocab_size=261",
                             "model.seq_length=16", "data.split=90,10,0", "training.train_iters=5",
                             "training.global_batch_size=4", "training.eval_iters=2", f"data.cache_dir={tmp_path}"])
    train, valid = build_gpt_datasets_from_config(cfg)
    assert len(train) >= 20 and len(valid) >= 8
    batch = collate(train, [0, 1, 2])
    assert set(batch) == {"tokens", "labels", "loss_mask"} and batch["tokens"].shape == (3, 16)
    assert batch["tokens"].dtype == torch.int64 and torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
    assert list(tmp_path.glob("bytes.train.*.shuffle_index.npy"))  # indices cached in data.cache_dir
    again, _ = build_gpt_datasets_from_config(cfg)
    assert all(np.array_equal(train[i]["tokens"], again[i]["tokens"]) for i in range(20))
    cfg.data.split = "1,0,0"
    with pytest.raises(ConfigError, match="leaves the valid split without documents"):
        build_gpt_datasets_from_config(cfg)


def test_data_tools_do_not_import_torch():
    code = ("import sys, megatron_moe.data.preprocess, megatron_moe.data.embedded_corpus, megatron_moe.data.blend; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
