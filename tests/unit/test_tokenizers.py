"""Tokenizer registry (Megatron-LM's type names): hand-checked ids on tiny vocabularies, round trips
on trained ones, special tokens for every type, tools/train_tokenizer.py, and clear errors."""
import json
import os
import sys

import pytest

from megatron_moe.config.errors import ConfigError
from megatron_moe.data.tokenizer_training import train_bpe, train_sentencepiece
from megatron_moe.data.tokenizers import TOKENIZERS, build_tokenizer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import train_tokenizer  # noqa: E402

TEXTS = [f"The {a} {b} jumps over the lazy dog number {i}.\nSo it goes: déjà vu, naïve café 日本語!"
         for i, (a, b) in enumerate([("quick", "fox"), ("slow", "cat"), ("brown", "bear")] * 30)]
PLAIN = "The quick fox, déjà vu — naïve 日本語 café!\n\tindented   spaces  "


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    bpe = train_bpe(str(d / "bpe"), 400, texts=TEXTS)
    spm_model = train_sentencepiece(str(d / "sp" / "spm"), 400, texts=TEXTS)
    return bpe, spm_model


def test_registry_has_megatron_names():
    assert TOKENIZERS.names() == sorted(["GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer",
                                         "BertWordPieceLowerCase", "BertWordPieceCase", "ByteTokenizer"])
    with pytest.raises(ConfigError, match="GPT2BPETokenizer"):
        build_tokenizer("GPT2Tokenizer")


def test_gpt2_bpe_hand_checked(tmp_path):
    """GPT-2 byte-level BPE: merges applied in rank order inside each pre-token ('Ġ' = space)."""
    vocab = {"h": 0, "e": 1, "l": 2, "o": 3, "Ġ": 4, "w": 5, "r": 6, "d": 7, "he": 8, "ll": 9, "hell": 10, "Ġw": 11}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\nh e\nl l\nhe ll\nĠ w\n")
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
                          merge_file=str(tmp_path / "merges.txt"))
    assert tok.tokenize("hello world") == [10, 3, 11, 3, 6, 2, 7]  # hell o | Ġw o r l d
    # none of the specials is in this vocabulary: appended in order cls, sep, mask, pad, eod
    assert (tok.cls, tok.sep, tok.mask, tok.pad, tok.eod, tok.vocab_size) == (12, 13, 14, 15, 16, 17)
    assert tok.detokenize([tok.cls] + tok.tokenize("hello world") + [tok.eod]) == "[CLS]hello world<|endoftext|>"


def test_bert_wordpiece_hand_checked(tmp_path):
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world", "##s", ",", "the", "Hello", "deja"]
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
    lower = build_tokenizer("BertWordPieceLowerCase", vocab_file=str(tmp_path / "vocab.txt"))
    cased = build_tokenizer("BertWordPieceCase", vocab_file=str(tmp_path / "vocab.txt"))
    text = "Hello Worlds, the déjà"
    assert lower.tokenize(text) == [5, 6, 7, 8, 9, 11]  # lower-cased, accents stripped, ##s, no [CLS]/[SEP]
    assert cased.tokenize(text) == [10, 1, 8, 9, 1]  # 'Worlds' and 'déjà' unknown when cased
    assert lower.detokenize(lower.tokenize(text)) == "hello worlds, the deja"
    for tok in (lower, cased):  # BERT's own specials from vocab.txt; eod appended as [EOS]
        assert (tok.pad, tok.cls, tok.sep, tok.mask, tok.eod, tok.vocab_size) == (0, 2, 3, 4, 12, 13)


def test_trained_bpe_gpt2_and_huggingface_agree(trained):
    bpe, _ = trained
    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=bpe["vocab_file"], merge_file=bpe["merge_file"])
    for path in (bpe["tokenizer_json"], os.path.dirname(bpe["tokenizer_json"])):
        hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=path)
        assert hf.tokenize(PLAIN) == gpt2.tokenize(PLAIN)
        assert hf.special_ids == gpt2.special_ids
    ids = gpt2.tokenize(PLAIN)
    assert gpt2.detokenize(ids) == PLAIN and len(ids) < len(PLAIN.encode())
    # the specials were trained into the vocabulary: nothing appended, ids 0..4
    assert gpt2.vocab_size == len(json.load(open(bpe["vocab_file"]))) <= 400
    assert (gpt2.eod, gpt2.cls, gpt2.sep, gpt2.mask, gpt2.pad) == (0, 1, 2, 3, 4)


def test_huggingface_special_tokens_map(tmp_path):
    train_bpe(str(tmp_path), 300, texts=TEXTS, special_tokens=["<s>", "</s>"])
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(
        {"cls_token": "<s>", "eos_token": {"content": "</s>"}, "pad_token": "<mypad>"}))
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    v = hf.base_vocab_size
    # declared and present: kept; missing: appended in order cls, sep, mask, pad, eod
    assert (hf.cls, hf.eod, hf.sep, hf.mask, hf.pad, hf.vocab_size) == (0, 1, v, v + 1, v + 2, v + 3)
    assert hf.detokenize([hf.sep, hf.pad]) == "[SEP]<mypad>"


def test_sentencepiece_round_trip_and_megatron_specials(trained):
    _, model = trained
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=model)
    assert tok.detokenize(tok.tokenize(PLAIN)) == PLAIN  # lossless: identity normalization + byte fallback
    # appended in Megatron-LM's order <CLS> <SEP> <EOD> <MASK> <PAD>
    assert (tok.cls, tok.sep, tok.eod, tok.mask, tok.pad, tok.vocab_size) == (400, 401, 402, 403, 404, 405)
    assert tok.detokenize([tok.cls] + tok.tokenize("The fox") + [tok.eod]) == "<CLS>The fox<EOD>"


def test_byte_tokenizer():
    tok = build_tokenizer("ByteTokenizer")
    assert tok.tokenize("aé") == [97, 0xC3, 0xA9] and tok.detokenize(tok.tokenize(PLAIN)) == PLAIN
    assert (tok.cls, tok.sep, tok.mask, tok.pad, tok.eod, tok.vocab_size) == (256, 257, 258, 259, 260, 261)


def test_train_tokenizer_cli(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(TEXTS))
    assert train_tokenizer.main(["--type", "bpe", "--input", str(corpus), "--vocab-size", "300",
                                 "--output-dir", str(tmp_path / "bpe")]) == 0
    assert train_tokenizer.main(["--type", "sentencepiece", "--input", str(corpus), "--vocab-size", "400",
                                 "--output-dir", str(tmp_path / "sp")]) == 0
    for tok in (build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "bpe" / "vocab.json"),
                                merge_file=str(tmp_path / "bpe" / "merges.txt")),
                build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "bpe" / "tokenizer.json")),
                build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "sp" / "spm.model"))):
        assert tok.detokenize(tok.tokenize(TEXTS[0])) == TEXTS[0]
    assert train_tokenizer.main(["--type", "sentencepiece", "--input", str(corpus), "--vocab-size", "50",
                                 "--output-dir", str(tmp_path / "sp2")]) == 2  # too small: one error line


def test_train_tokenizer_replaces_its_output_whole_and_exits_2_on_user_errors(tmp_path, capsys):
    """--output-dir is written beside itself and renamed in when complete: a failed training (a crash
    alike) leaves the previous tokenizer whole and no partial directory; user errors exit 2."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(TEXTS))
    out = tmp_path / "sp"
    assert train_tokenizer.main(["--type", "sentencepiece", "--input", str(corpus), "--vocab-size", "400",
                                 "--output-dir", str(out)]) == 0
    before = (out / "spm.model").read_bytes()
    assert train_tokenizer.main(["--type", "sentencepiece", "--input", str(corpus), "--vocab-size", "50",
                                 "--output-dir", str(out)]) == 2  # fails inside the training
    assert (out / "spm.model").read_bytes() == before and sorted(os.listdir(tmp_path)) == ["corpus.txt", "sp"]
    assert train_tokenizer.main(["--input", str(tmp_path / "missing.txt"), "--vocab-size", "300",
                                 "--output-dir", str(out)]) == 2
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "notes.txt").write_text("mine")
    assert train_tokenizer.main(["--input", str(corpus), "--vocab-size", "300", "--output-dir",
                                 str(tmp_path / "mixed")]) == 2
    assert (tmp_path / "mixed" / "notes.txt").read_text() == "mine"
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and "holds other files (notes.txt)" in err[2], err


@pytest.mark.parametrize("kind,kwargs,needle", [
    ("GPT2BPETokenizer", {}, "needs a vocab file (--vocab-file"),
    ("GPT2BPETokenizer", {"vocab_file": "/nonexistent/vocab.json", "merge_file": "m"}, "/nonexistent/vocab.json: not found"),
    ("SentencePieceTokenizer", {}, "needs a model (--tokenizer-model"),
    ("HuggingFaceTokenizer", {"tokenizer_model": "gpt2"}, "gpt2: not found"),  # never a hub download
    ("BertWordPieceCase", {}, "needs a vocab file"),
])
def test_missing_files_one_line(kind, kwargs, needle):
    with pytest.raises(ValueError) as e:
        build_tokenizer(kind, **kwargs)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_unreadable_files_one_line(tmp_path):
    bad = tmp_path / "bad.model"
    bad.write_text("not a model")
    for kind, kwargs in [("SentencePieceTokenizer", {"tokenizer_model": str(bad)}),
                         ("HuggingFaceTokenizer", {"tokenizer_model": str(bad)}),
                         ("GPT2BPETokenizer", {"vocab_file": str(bad), "merge_file": str(bad)})]:
        with pytest.raises(ValueError) as e:
            build_tokenizer(kind, **kwargs)
        assert str(bad) in str(e.value) and "\n" not in str(e.value)
