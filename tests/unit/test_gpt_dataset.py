"""GPT dataset and blending: samples are seq_length + 1 consecutive tokens of the per-epoch shuffled
document stream (checked against a stream rebuilt here from the raw documents), deterministic
from the seed, stable when more samples are asked for, cached; splits; blend ratios."""
import numpy as np
import pytest

from megatron_moe.data.blend import BlendedDataset, blend_indices, build_gpt_datasets, parse_blend
from megatron_moe.data.gpt_dataset import GPTDataset, parse_split, split_ranges
from megatron_moe.data.indexed import IndexedDataset, IndexedDatasetBuilder

L = 16


def make_corpus(prefix, num_docs, base=0, seed=0):
    """Token = base + 100 * document + position; some documents are empty, some have 2 sequences."""
    rng = np.random.default_rng(seed)
    docs = [base + 100 * d + np.arange(rng.integers(0, 31)) for d in range(num_docs)]
    b = IndexedDatasetBuilder(str(prefix), np.int32)
    for d in docs:
        cut = len(d) // 2 if len(d) > 4 and rng.random() < 0.5 else len(d)
        b.add_document(d, [n for n in (cut, len(d) - cut) if n])
    b.finalize()
    return str(prefix), docs


def check_against_stream(ds, docs, documents):
    """Every sample equals tokens [j*L, j*L + L] of the stream of `ds.document_index`, j = shuffle_index[i]."""
    n = documents[1] - documents[0]
    blocks = np.asarray(ds.document_index).reshape(-1, n)  # one block per epoch
    for block in blocks:
        assert sorted(block.tolist()) == list(range(*documents))  # each epoch: every document once
    stream = np.concatenate([docs[d] for d in ds.document_index])
    for i in range(len(ds)):
        j = int(ds.shuffle_index[i])
        s = ds[i]
        assert s["tokens"].dtype == np.int64 and s["loss_mask"].dtype == np.float32
        np.testing.assert_array_equal(s["tokens"], stream[j * L:j * L + L])
        np.testing.assert_array_equal(s["labels"], stream[j * L + 1:j * L + L + 1])
        np.testing.assert_array_equal(s["loss_mask"], np.ones(L))
    # the samples starting in epoch e are permuted among themselves
    tokens_per_epoch = sum(len(docs[d]) for d in range(*documents))
    epochs, hi = 0, 0
    while hi < len(ds):
        lo, hi = -(-epochs * tokens_per_epoch // L), -(-(epochs + 1) * tokens_per_epoch // L)
        assert sorted(np.asarray(ds.shuffle_index[lo:hi]).tolist()) == list(range(lo, hi))
        epochs += 1
    assert hi == len(ds) and len(blocks) > epochs  # whole epochs, plus the stream's tail


def test_samples_cross_documents_and_match_stream(tmp_path):
    prefix, docs = make_corpus(tmp_path / "c", 60)
    ds = GPTDataset(IndexedDataset(prefix), (5, 55), L, num_samples=200, seed=7)
    assert len(ds) >= 200
    check_against_stream(ds, docs, (5, 55))
    crossing = sum(len(set((ds[i]["tokens"] // 100).tolist())) > 1 for i in range(len(ds)))
    assert crossing > len(ds) // 4  # many samples span a document boundary
    assert not np.array_equal(np.asarray(ds.document_index[:50]), np.arange(5, 55))  # shuffled


def test_deterministic_from_seed_and_stable_in_num_samples(tmp_path):
    prefix, _ = make_corpus(tmp_path / "c", 40)
    data = IndexedDataset(prefix)
    a = GPTDataset(data, (0, 40), L, 300, seed=3, cache_dir=str(tmp_path / "ca"))
    b = GPTDataset(data, (0, 40), L, 300, seed=3, cache_dir=str(tmp_path / "cb"))  # built again elsewhere
    other = GPTDataset(data, (0, 40), L, 300, seed=4, cache_dir=str(tmp_path / "ca"))
    small = GPTDataset(data, (0, 40), L, 10, seed=3, cache_dir=str(tmp_path / "ca"))
    assert len(small) < len(a)
    for i in range(len(a)):
        np.testing.assert_array_equal(a[i]["tokens"], b[i]["tokens"])
    for i in range(len(small)):  # more samples = more epochs appended; earlier samples unchanged
        np.testing.assert_array_equal(a[i]["tokens"], small[i]["tokens"])
    assert any(not np.array_equal(a[i]["tokens"], other[i]["tokens"]) for i in range(len(a)))


def test_indices_cached_next_to_data(tmp_path, monkeypatch):
    prefix, docs = make_corpus(tmp_path / "c", 30)
    first = GPTDataset(IndexedDataset(prefix), (0, 30), L, 50, seed=1)
    cached = sorted(p.name for p in tmp_path.glob("c.train.*.npy"))
    assert len(cached) == 3 and all(n.split(".")[3] in ("document_index", "sample_index", "shuffle_index")
                                    for n in cached)

    def fail(*a):
        raise AssertionError("indices rebuilt instead of loaded from the cache")

    monkeypatch.setattr(GPTDataset, "_build_indices", fail)
    again = GPTDataset(IndexedDataset(prefix), (0, 30), L, 50, seed=1)
    assert isinstance(again.shuffle_index, np.memmap)
    np.testing.assert_array_equal(first[17]["tokens"], again[17]["tokens"])


def test_split_ranges_megatron_rounding():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.030, 0.001])
    assert split_ranges(1000, parse_split("969,30,1")) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges(7, parse_split("90/5/5")) == [(0, 7), (7, 7), (7, 7)]
    assert split_ranges(10, parse_split("8,1,1")) == [(0, 8), (8, 9), (9, 10)]
    assert split_ranges(5, parse_split("1")) == [(0, 5), (5, 5), (5, 5)]
    with pytest.raises(ValueError, match="data.split"):
        parse_split("none")


def test_blend_ratios_hold_for_every_prefix():
    for weights in ([0.3, 0.7], [1, 2, 3, 0, 4], [0.01, 0.99]):
        dataset_index, sample_index = blend_indices(weights, 5000)
        w = np.asarray(weights) / sum(weights)
        counts = np.cumsum(np.eye(len(w))[dataset_index], axis=0)  # [n, datasets]
        assert np.abs(counts - np.arange(1, 5001)[:, None] * w).max() < 1.0
        for d in range(len(w)):  # each dataset's samples are taken in order 0, 1, 2, ...
            np.testing.assert_array_equal(sample_index[dataset_index == d], np.arange((dataset_index == d).sum()))
        np.testing.assert_array_equal(blend_indices(weights, 123)[0], dataset_index[:123])


def test_build_blended_splits(tmp_path):
    a, docs_a = make_corpus(tmp_path / "a", 50, base=0, seed=1)
    b, docs_b = make_corpus(tmp_path / "b", 50, base=10000, seed=2)
    train, valid, test = build_gpt_datasets([0.3, a, 0.7, b], "8,2,0", L, seed=5, num_samples=(400, 40, 40))
    assert test is None and isinstance(train, BlendedDataset) and len(train) == 400 and len(valid) == 40
    from_b = np.array([train[i]["tokens"][0] >= 10000 for i in range(400)])
    assert np.abs(np.cumsum(from_b) - 0.7 * np.arange(1, 401)).max() < 1.0
    single = build_gpt_datasets([b], "8,2,0", L, seed=5, num_samples=(400, 40, 0))[0]
    k = int(train.dataset_sample_index[3])
    np.testing.assert_array_equal(train[3]["tokens"], train.datasets[train.dataset_index[3]][k]["tokens"])
    # a component of the blend is the same dataset as that prefix alone (same seed, split and documents)
    np.testing.assert_array_equal(train.datasets[1][0]["tokens"], single[0]["tokens"])
    # without weights: proportional to the tokens of each prefix's train split (documents 0..39)
    unweighted = build_gpt_datasets([a, b], "8,2,0", L, seed=5, num_samples=(100, 0, 0))[0]
    ta, tb = sum(map(len, docs_a[:40])), sum(map(len, docs_b[:40]))
    share_b = np.cumsum(np.asarray(unweighted.dataset_index) == 1)
    assert np.abs(share_b - tb / (ta + tb) * np.arange(1, 101)).max() < 1.0


@pytest.mark.parametrize("path,needle", [([], "empty"), ([0.5, "a", "b"], "weight, prefix"),
                                         ([-1, "a", 2, "b"], "non-negative")])
def test_parse_blend_errors(path, needle):
    with pytest.raises(ValueError, match=needle):
        parse_blend(path)


def test_split_without_tokens_is_an_error(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "e"), np.uint16)
    for _ in range(3):
        b.add_document([], [])
    b.finalize()
    with pytest.raises(ValueError, match="train split .* has no tokens"):
        build_gpt_datasets([str(tmp_path / "e")], "1", L, seed=1, num_samples=(1, 0, 0))
