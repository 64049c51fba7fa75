"""tools/train_tokenizer.py on a corpus of documents (issue #43 item 6: it learned `{"` and `":`
from a JSON-lines file read as raw text) and what it prints about the trained tokenizer (item 7:
its size with the special tokens each type adds, and the padded model.vocab_size)."""
import json
import os
import sys

import pytest
import sentencepiece as spm

from megatron_moe.data.tokenizers import build_tokenizer, recommended_vocab_size

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import train_tokenizer  # noqa: E402

TEXTS = [f"The {a} {b} jumps over the lazy dog number {i}.\nSo it goes: déjà vu, naïve café!"
         for i, (a, b) in enumerate([("quick", "fox"), ("slow", "cat"), ("brown", "bear")] * 40)]
JSON_SYNTAX = ('{"', '":', '", "', '"}')


@pytest.fixture()
def jsonl(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t, "meta": {"url": f"https://x/{i}"}}) + "\n"
                            for i, t in enumerate(TEXTS)))
    return path


def test_jsonl_is_read_by_its_keys_not_as_raw_text(jsonl, tmp_path, capsys):
    assert train_tokenizer.main(["--type", "bpe", "--input", str(jsonl), "--vocab-size", "400",
                                 "--output-dir", str(tmp_path / "bpe")]) == 0
    learned = json.loads((tmp_path / "bpe" / "vocab.json").read_text())
    assert not [t for t in learned if any(s in t for s in JSON_SYNTAX)]
    assert "https" not in "".join(learned)  # the `meta` key is not text: only --json-keys (text) is read
    assert any("jumps" in t for t in learned)  # the documents' text is
    assert train_tokenizer.main(["--type", "sentencepiece", "--input", str(jsonl), "--vocab-size", "400",
                                 "--output-dir", str(tmp_path / "sp")]) == 0
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp" / "spm.model"))
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    assert not [p for p in pieces if any(s in p for s in JSON_SYNTAX)]
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "sp" / "spm.model"))
    assert tok.detokenize(tok.tokenize(TEXTS[0])) == TEXTS[0]
    capsys.readouterr()
    # another key, or a missing one: one line naming the file and line, as preprocess_data says it
    assert train_tokenizer.main(["--input", str(jsonl), "--json-keys", "body", "--vocab-size", "300",
                                 "--output-dir", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {jsonl}:1: no key 'body' (keys: ['meta', 'text'])\n"


def test_prints_specials_and_the_model_vocab_size(tmp_path, capsys):
    corpus = tmp_path / "a.txt"
    corpus.write_text("\n".join(TEXTS))
    assert train_tokenizer.main(["--type", "sentencepiece", "--input", str(corpus), "--vocab-size", "400",
                                 "--output-dir", str(tmp_path / "sp")]) == 0
    out = capsys.readouterr().out
    # the ids docs/data.md documents: <CLS> <SEP> <EOD> <MASK> <PAD> appended after the pieces
    assert ("SentencePieceTokenizer: 405 tokens: 400 in the vocabulary + 5 appended specials (cls <CLS>=400 "
            "sep <SEP>=401 eod <EOD>=402 mask <MASK>=403 pad <PAD>=404); model.vocab_size >= 405 "
            "(Megatron pads to a multiple of 128: 512)") in out
    assert train_tokenizer.main(["--type", "bpe", "--input", str(corpus), "--vocab-size", "300",
                                 "--output-dir", str(tmp_path / "bpe")]) == 0
    out = capsys.readouterr().out
    for name in ("GPT2BPETokenizer", "HuggingFaceTokenizer"):  # trained in: ids 0-4, nothing appended
        assert (f"{name}: 300 tokens, the specials in the vocabulary (cls [CLS]=1 sep [SEP]=2 mask [MASK]=3 "
                "pad [PAD]=4 eod <|endoftext|>=0); model.vocab_size >= 300 (Megatron pads to a multiple of 128: 384)"
                in out), out
    assert build_tokenizer("ByteTokenizer").describe() == (
        "261 tokens: 256 in the vocabulary + 5 appended specials (cls [CLS]=256 sep [SEP]=257 mask [MASK]=258 "
        "pad [PAD]=259 eod <|endoftext|>=260)")
    assert [recommended_vocab_size(n) for n in (1, 128, 129, 4005)] == [128, 128, 256, 4096]
