"""BERT data (segments, sentence pairs, sop/nsp labels, 80/10/10 masking statistics, determinism)
and the BERT-MoE model (bidirectional, padding-masked, tied MLM head, binary head)."""
import numpy as np
import pytest
import torch

from megatron_moe.config import load_config
from megatron_moe.data.bert_dataset import BertDataset, build_segments, truncate_pair
from megatron_moe.data.indexed import IndexedDataset, IndexedDatasetBuilder
from megatron_moe.data.tokenizers import build_tokenizer
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.bert import BertMoEModel

TOK = build_tokenizer("ByteTokenizer")  # cls 256, sep 257, mask 258, pad 259, eod 260


@pytest.fixture(scope="module")
def sentences(tmp_path_factory):
    """40 documents of 1..6 sentences; global sentence g holds (g % 250 + 1) repeated 3..8 times, the
    document's last sentence ends with eod (as preprocess_data.py --append-eod writes it)."""
    prefix = str(tmp_path_factory.mktemp("bert") / "s_text_sentence")
    builder = IndexedDatasetBuilder(prefix, dtype=np.uint16)
    g = 0
    for d in range(40):
        lengths, tokens = [], []
        for j in range(1 + d % 6):
            n = 3 + (g * 7) % 6
            tokens += [g % 250 + 1] * n
            lengths.append(n)
            g += 1
        tokens.append(TOK.eod)
        lengths[-1] += 1
        builder.add_document(tokens, lengths)
    builder.finalize()
    return IndexedDataset(prefix)


def make(data, tmp_path, binary_head="sop", seq_length=64, num_samples=400, seed=3):
    return BertDataset(data, (0, 40), TOK, seq_length, num_samples, seed, binary_head, 0.15, str(tmp_path))


def original(sample):
    """Undo the masking: predicted positions hold their original token in `labels`."""
    return np.where(sample["loss_mask"] > 0, sample["labels"], sample["tokens"])


def segments_of(sample):
    ids, types, n = original(sample), sample["token_types"], int(sample["padding_mask"].sum())
    first_sep = int(np.flatnonzero(ids == TOK.sep)[0])
    assert ids[0] == TOK.cls and ids[n - 1] == TOK.sep and (ids[n:] == TOK.pad).all()
    assert (types[:first_sep + 1] == 0).all() and (types[first_sep + 1:n] == 1).all() and (types[n:] == 0).all()
    return ids[1:first_sep], ids[first_sep + 1:n - 1]


def test_segments_cover_multi_sentence_runs(sentences):
    segs = build_segments(sentences, (0, 40), target_tokens=12)
    assert (segs[:, 1] - segs[:, 0] >= 2).all()
    lengths = sentences.sequence_lengths
    for first, end in segs:  # each run stops as soon as it holds >= 12 tokens
        assert lengths[first:end - 1].sum() < 12
    whole = build_segments(sentences, (0, 40), target_tokens=1000)
    docs = sentences.document_indices
    assert [tuple(s) for s in whole] == [(docs[d], docs[d + 1]) for d in range(40) if docs[d + 1] - docs[d] >= 2]


def test_sop_pairs_and_determinism(sentences, tmp_path):
    ds = make(sentences, tmp_path)
    labels = []
    for i in range(200):
        s = ds[i]
        a, b = segments_of(s)
        assert len(a) and len(b) and TOK.eod not in a and TOK.eod not in b
        assert (np.diff(a) >= 0).all() and (np.diff(b) >= 0).all()  # sentences in document order within A, B
        label = int(s["binary_labels"])
        first, second = (a, b) if label == 0 else (b, a)
        assert second[0] == first[-1] + 1  # consecutive sentences of one document, swapped iff label 1
        labels.append(label)
    assert 0.35 < np.mean(labels) < 0.65
    again = make(sentences, tmp_path)
    for i in (0, 7, 399):
        for key, value in ds[i].items():
            np.testing.assert_array_equal(value, again[i][key])
    other = make(sentences, tmp_path, seed=4)
    assert any(not np.array_equal(ds[i]["tokens"], other[i]["tokens"]) for i in range(5))
    # every epoch visits each segment once (sentence g holds token g + 1; A and B cover the segment)
    n, firsts = len(ds.segments), sorted(int(f) + 1 for f, _ in ds.segments)
    for epoch in (0, 1):
        assert sorted(min(np.concatenate(segments_of(ds[i]))) for i in range(epoch * n, epoch * n + n)) == firsts


def test_nsp_pairs(sentences, tmp_path):
    ds = make(sentences, tmp_path, binary_head="nsp")
    firsts = {int(f) for f, _ in ds.segments}
    labels = []
    for i in range(200):
        s = ds[i]
        a, b = segments_of(s)
        if int(s["binary_labels"]) == 0:
            assert b[0] == a[-1] + 1
        else:  # B is another segment's beginning
            assert b[0] - 1 in firsts and b[0] != a[-1] + 1
        labels.append(int(s["binary_labels"]))
    assert 0.35 < np.mean(labels) < 0.65


def test_masking_statistics(sentences, tmp_path):
    ds = make(sentences, tmp_path, binary_head="none")
    predicted = candidates = masked = random = kept = 0
    for i in range(400):
        s = ds[i]
        ids = original(s)
        real = ~np.isin(ids, [TOK.cls, TOK.sep, TOK.pad])
        sel = s["loss_mask"] > 0
        assert (real[sel]).all() and sel.sum() == max(1, round(0.15 * real.sum()))
        assert (s["labels"][~sel] == 0).all() and int(s["binary_labels"]) == 0
        predicted += sel.sum()
        candidates += real.sum()
        masked += (s["tokens"][sel] == TOK.mask).sum()
        kept += (s["tokens"][sel] == ids[sel]).sum()
        assert (s["tokens"][~sel] == ids[~sel]).all()
    random = predicted - masked - kept
    assert predicted / candidates == pytest.approx(0.15, abs=0.01)
    assert masked / predicted == pytest.approx(0.8, abs=0.03)
    assert random / predicted == pytest.approx(0.1, abs=0.025)
    assert kept / predicted == pytest.approx(0.1, abs=0.025)


def test_truncate_pair_trims_the_longer_end():
    a, b = np.arange(10), np.arange(100, 103)
    ta, tb = truncate_pair(a, b, 8)
    assert list(ta) == [0, 1, 2, 3, 4] and list(tb) == [100, 101, 102]
    ta, tb = truncate_pair(np.arange(6), np.arange(6), 7)
    assert len(ta) + len(tb) == 7 and abs(len(ta) - len(tb)) == 1
    assert truncate_pair(a, b, 20) == (a, b)


def test_bert_model_is_bidirectional_with_padding_and_tied_head():
    cfg = load_config("configs/bert_moe_tiny.yaml",
                      ["model.seq_length=12", "model.vocab_size=300", "moe.num_experts=4"])
    model = BertMoEModel(cfg, ParallelState.single_process())
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (2, 12), generator=gen)
    types = torch.zeros(2, 12, dtype=torch.long)
    types[:, 6:] = 1
    pad = torch.ones(2, 12)
    pad[1, 9:] = 0
    logits = model(tokens, types, pad).logits  # [2, 12, V]
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    logits2 = model(changed, types, pad).logits
    assert not torch.allclose(logits[0, 2], logits2[0, 2])  # position 2 sees position 10: bidirectional
    torch.testing.assert_close(logits[1, :9], logits2[1, :9])  # ... unless position 10 is padding
    labels = torch.randint(0, 256, (2, 12), generator=gen)
    loss_mask = torch.zeros(2, 12)
    loss_mask[:, [1, 4]] = 1
    out = model(tokens, types, pad, labels, loss_mask, torch.tensor([0, 1]))
    lp = torch.log_softmax(logits[..., :300], -1)
    ref = -lp.gather(-1, labels[..., None])[..., 0][:, [1, 4]].mean()
    torch.testing.assert_close(out.lm_loss, ref)
    assert out.binary_loss is not None and 0.3 < float(out.binary_loss.detach()) < 1.5
    (out.lm_loss + out.binary_loss).backward()
    assert model.embedding.word.weight.grad.abs().sum() > 0 and model.embedding.token_type.grad.abs().sum() > 0
    assert model.mlm_bias.grad.abs().sum() > 0 and model.pooler.weight.grad.abs().sum() > 0
    assert not any("output" in n for n, _ in model.named_parameters())  # tied: no separate output matrix


def test_bert_datasets_from_config(sentences, tmp_path):
    from megatron_moe.config import ConfigError
    from megatron_moe.data.bert_dataset import build_bert_datasets_from_config

    base = ["data.tokenizer.type=ByteTokenizer", "model.vocab_size=261", "model.seq_length=16", "data.split=80,20,0",
            "training.train_iters=3", "training.global_batch_size=4", "training.eval_iters=1",
            f"data.cache_dir={tmp_path}"]
    train, valid = build_bert_datasets_from_config(load_config(None, base + [f"data.path=[{sentences.prefix}]"]))
    assert (len(train), len(valid)) == (12, 4)
    assert {k: v.shape for k, v in train[0].items()} == {
        "tokens": (16,), "token_types": (16,), "padding_mask": (16,), "labels": (16,), "loss_mask": (16,),
        "binary_labels": ()}
    assert int(train.segments.max()) <= sentences.document_indices[32] < int(valid.segments.min()) + 1
    with pytest.raises(ConfigError, match="BERT reads one sentence-split prefix"):
        two = f"data.path=[{sentences.prefix},{sentences.prefix}]"
        build_bert_datasets_from_config(load_config(None, base + [two]))
