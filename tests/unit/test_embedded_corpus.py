"""Embedded demo corpus: built once from the standard library's sources, reused, verified by hash,
rebuilt when damaged, identical when built twice (also concurrently), usable by the GPT dataset."""
import os
import threading

import numpy as np

from megatron_moe.data.blend import build_gpt_datasets
from megatron_moe.data.embedded_corpus import collect_documents, ensure_embedded_corpus
from megatron_moe.data.indexed import IndexedDataset

SMALL = dict(vocab_size=512, max_bytes=150_000)


def files_of(corpus):
    return {n: open(os.path.join(corpus.directory, n), "rb").read() for n in sorted(os.listdir(corpus.directory))}


def test_documents_are_deterministic_and_capped():
    docs = collect_documents(100_000)
    assert docs == collect_documents(100_000) and len(docs) > 10 and all(d.strip() for d in docs)
    size = sum(len(d.encode()) for d in docs)
    assert size >= 100_000 and size - len(docs[-1].encode()) < 100_000
    assert any("def " in d for d in docs)


def test_build_reuse_verify_rebuild(tmp_path):
    corpus = ensure_embedded_corpus(str(tmp_path), **SMALL)
    docs = collect_documents(SMALL["max_bytes"])
    tok = corpus.tokenizer.build()
    assert tok.vocab_size == corpus.vocab_size == 512
    ds = IndexedDataset(corpus.document_prefix)
    assert ds.num_documents == len(docs) == len(ds) and ds.dtype == np.uint16
    np.testing.assert_array_equal(ds[0], tok.tokenize(docs[0]) + [tok.eod])
    assert tok.detokenize(ds[3][:-1]) == docs[3]
    sentences = IndexedDataset(corpus.sentence_prefix)
    assert sentences.num_documents == len(docs) and len(sentences) > len(docs)

    before = files_of(corpus)
    bin_path = corpus.document_prefix + ".bin"
    mtime = os.stat(bin_path).st_mtime_ns
    assert ensure_embedded_corpus(str(tmp_path), **SMALL) == corpus
    assert os.stat(bin_path).st_mtime_ns == mtime  # reused, not rebuilt
    with open(bin_path, "ab") as f:
        f.write(b"\x00\x00")  # damage: the manifest's hash no longer matches
    assert ensure_embedded_corpus(str(tmp_path), **SMALL) == corpus
    assert files_of(corpus) == before

    train, valid, _ = build_gpt_datasets([corpus.document_prefix], "969,30,1", 64, seed=1,
                                         num_samples=(32, 8, 0))
    assert len(train) >= 32 and len(valid) >= 8 and int(train[0]["tokens"].max()) < tok.vocab_size


def test_concurrent_builds_agree(tmp_path):
    results = []
    threads = [threading.Thread(target=lambda: results.append(ensure_embedded_corpus(str(tmp_path), **SMALL)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1]
    assert not [n for n in os.listdir(os.path.dirname(results[0].directory)) if ".tmp" in n]
    other = ensure_embedded_corpus(str(tmp_path / "again"), **SMALL)  # a second, independent build
    assert files_of(other) == files_of(results[0])
