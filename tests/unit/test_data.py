"""Demo corpus and the layout-independent assignment of samples to ranks."""
import pytest
import torch

from megatron_moe.config import ConfigError, load_config
from megatron_moe.data import GlobalBatchSampler, build_datasets, check_data_config, collate, rank_micro_batches
from megatron_moe.data.demo_corpus import MAX_BYTES, corpus_documents, split_fractions, split_tokens


def test_demo_corpus_samples():
    docs = corpus_documents()
    assert len(docs) > 100 and 1 << 20 < sum(map(len, docs)) <= MAX_BYTES
    assert sum(d.count(b"\ndef ") for d in docs[:10]) > 5  # Python source
    train_tokens, valid_tokens, test_tokens = split_tokens("90,10,0")
    assert train_tokens.dtype == torch.int64 and int(train_tokens.max()) < 256
    assert train_tokens.numel() + valid_tokens.numel() == sum(map(len, docs)) and test_tokens.numel() == 0
    assert 0.03 < valid_tokens.numel() / train_tokens.numel() < 0.3  # whole documents, about 10%
    train, valid = build_datasets(load_config(None, ["model.seq_length=16", "data.split=90,10,0"]))
    assert len(train) == (train_tokens.numel() - 1) // 16 and len(valid) == (valid_tokens.numel() - 1) // 16
    tokens, labels, mask = train[3]
    assert torch.equal(tokens, train_tokens[48:64]) and torch.equal(labels, train_tokens[49:65])
    assert mask.shape == (16,) and bool((mask == 1).all())
    assert torch.equal(valid[0][0], valid_tokens[:16])
    t, l, m = collate(train, [3, 5])
    assert t.shape == l.shape == m.shape == (2, 16) and torch.equal(t[1], train[5][0])
    with pytest.raises(ConfigError, match="no train or no valid"):
        build_datasets(load_config(None, ["data.split=1,0,0"]))


def test_global_batches_depend_on_seed_only_and_cover_each_epoch():
    s = GlobalBatchSampler(num_samples=10, global_batch_size=4, seed=7)
    first = [s.batch(i) for i in range(5)]  # 20 samples = 2 epochs
    assert sorted(first[0] + first[1] + first[2][:2]) == list(range(10))
    assert sorted(first[2][2:] + first[3] + first[4]) == list(range(10))
    assert first[0] != sorted(first[0]) or first[1] != sorted(first[1])  # shuffled
    again = GlobalBatchSampler(10, 4, 7)
    assert [again.batch(i) for i in (3, 0)] == [first[3], first[0]]  # random access, same result
    assert GlobalBatchSampler(10, 4, 8).batch(0) != first[0]
    assert GlobalBatchSampler(10, 4, 7, shuffle=False).batch(3) == [2, 3, 4, 5]


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_micro_batches_are_layout_independent(dp):
    samples = list(range(100, 116))  # a global batch of 16, micro-batch size 2 -> 8 micro-batches
    per_rank = [rank_micro_batches(samples, 2, dp, d) for d in range(dp)]
    assert all(len(r) == 8 // dp for r in per_rank)
    for d, micro in enumerate(per_rank):
        for k, mb in enumerate(micro):
            j = k * dp + d  # global micro-batch index
            assert mb == samples[2 * j: 2 * j + 2]


def test_data_config_errors():
    with pytest.raises(ConfigError, match="data.path"):
        check_data_config(load_config(None, ["data.path=[a]"]))
    with pytest.raises(ConfigError, match="model.vocab_size=100"):
        check_data_config(load_config(None, ["model.vocab_size=100"]))
    with pytest.raises(ConfigError, match="data.split"):
        split_fractions("a,b")
    assert split_fractions("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
