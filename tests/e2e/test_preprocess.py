"""tools/preprocess_data.py end to end: Megatron-LM naming, token contents, identical bytes for any
--workers, sentence splitting, json/parquet/txt inputs, progress line, and one-line errors."""
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_moe.data.indexed import IndexedDataset
from megatron_moe.data.preprocess import InputError, JsonlSource, Progress, split_sentences
from megatron_moe.data.tokenizer_training import train_bpe
from megatron_moe.data.tokenizers import build_tokenizer

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
TOOL = os.path.join(ROOT, "tools", "preprocess_data.py")
sys.path.insert(0, os.path.join(ROOT, "tools"))
import preprocess_data  # noqa: E402

pytestmark = pytest.mark.e2e

DOCS = [{"text": f"Document {i}: the quick brown fox {'jumps ' * (i % 7)}over the lazy dog. Ünïcödé {i}!",
         "title": f"Title {i}"} for i in range(40)]
DOCS[5]["text"] = ""  # an empty document: no sequences, still a document


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("pre")
    files = train_bpe(str(d / "tok"), 300, texts=[x["text"] for x in DOCS])
    jsonl = d / "docs.jsonl"
    jsonl.write_text("".join(json.dumps(x) + "\n" for x in DOCS))
    flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", files["vocab_file"],
             "--merge-file", files["merge_file"], "--append-eod", "--no-progress"]
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=files["vocab_file"], merge_file=files["merge_file"])
    return d, jsonl, flags, tok


def read(prefix):
    return open(prefix + ".bin", "rb").read(), open(prefix + ".idx", "rb").read()


def test_workers_give_identical_bytes_and_right_tokens(corpus):
    d, jsonl, flags, tok = corpus
    assert preprocess_data.main(["--input", str(jsonl), "--json-keys", "text", "title",
                                 "--output-prefix", str(d / "w1"), "--workers", "1"] + flags) == 0
    run = subprocess.run([sys.executable, TOOL, "--input", str(jsonl), "--json-keys", "text", "title",
                          "--output-prefix", str(d / "w2"), "--workers", "2"] + flags,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    for key in ("text", "title"):
        assert read(str(d / f"w1_{key}_document")) == read(str(d / f"w2_{key}_document"))
    ds = IndexedDataset(str(d / "w2_text_document"))
    assert ds.dtype == np.uint16 and ds.num_documents == 40 and len(ds) == 39  # document 5 is empty
    assert ds.document_indices[5] == ds.document_indices[6] == 5
    for i, doc in enumerate(x for x in DOCS if x["text"]):
        np.testing.assert_array_equal(ds[i], tok.tokenize(doc["text"]) + [tok.eod])
        assert tok.detokenize(ds[i][:-1]) == doc["text"]


def test_split_sentences(corpus):
    d, jsonl, flags, tok = corpus
    assert preprocess_data.main(["--input", str(jsonl), "--output-prefix", str(d / "s"),
                                 "--split-sentences"] + flags) == 0
    ds = IndexedDataset(str(d / "s_text_sentence"))
    assert ds.num_documents == 40
    first, last = ds.document_indices[0], ds.document_indices[1]
    sentences = split_sentences(DOCS[0]["text"])
    assert len(sentences) == last - first == 2
    for k, sentence in enumerate(sentences):
        expected = tok.tokenize(sentence) + ([tok.eod] if k == len(sentences) - 1 else [])
        np.testing.assert_array_equal(ds[first + k], expected)


def test_sentence_splitter_rules():
    text = 'Dr. Smith arrived, e.g. at noon. He said "Hi." Then left! 3 cats? J. R. Tolkien wrote.\n\nnext para'
    assert split_sentences(text) == ["Dr. Smith arrived, e.g. at noon.", 'He said "Hi."', "Then left!", "3 cats?",
                                     "J. R. Tolkien wrote.", "next para"]
    assert split_sentences("One. Two.\nThree", keep_newlines=True) == ["One. ", "Two.\n", "Three"]


def test_hf_datasets_inputs_match_jsonl(corpus, tmp_path):
    pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    d, jsonl, flags, _ = corpus
    inputs = {"parquet": tmp_path / "docs.parquet", "json": tmp_path / "docs.json", "txt": tmp_path / "docs.txt"}
    pq.write_table(pa.Table.from_pylist(DOCS), str(inputs["parquet"]))
    inputs["json"].write_text(json.dumps(DOCS))  # one JSON array, not JSON lines
    inputs["txt"].write_text("".join(x["text"] + "\n" for x in DOCS))  # one document per line
    assert preprocess_data.main(["--input", str(jsonl), "--output-prefix", str(tmp_path / "ref")] + flags) == 0
    for name, path in inputs.items():
        assert preprocess_data.main(["--input", str(path), "--output-prefix", str(tmp_path / name)] + flags) == 0
        assert read(str(tmp_path / f"{name}_text_document")) == read(str(tmp_path / "ref_text_document")), name


def test_jsonl_shards_cover_every_line_once(tmp_path):
    path = tmp_path / "s.jsonl"
    lines = [json.dumps({"text": "x" * (i * 7 % 23), "i": i}) for i in range(57)]
    path.write_text("\n".join(lines[:20]) + "\n\n" + "\n".join(lines[20:]))  # a blank line, no final newline
    src = JsonlSource(str(path))
    for n in (1, 2, 3, 5, 64):
        seen = [doc["i"] for k in range(n) for _, doc, _ in src.shard(k, n)]
        assert seen == list(range(57)), n
        assert sum(c for k in range(n) for _, _, c in src.shard(k, n)) == os.path.getsize(path) - 1


def test_error_line_numbers_in_any_shard(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps({"text": "ok"}) + "\n" for _ in range(30)) + "{broken\n")
    src = JsonlSource(str(path))
    with pytest.raises(InputError) as e:
        list(src.shard(1, 2))
    assert src.describe(e.value.where) == f"{path}:31"


def test_progress_line():
    out = io.StringIO()
    p = Progress(1000, stream=out)
    p.update(50, 500, final=True)
    line = out.getvalue()
    assert "50.0%" in line and "50 docs" in line and "docs/s" in line and "ETA" in line


@pytest.mark.parametrize("content,needle", [
    ("", "no documents (the input is empty)"),
    ('{"text": "a"}\n{"text": "b"}\nnot json\n', ":3: not valid JSON"),
    ('{"text": "a"}\n[1, 2]\n', ":2: expected a JSON object"),
    ('{"text": "a"}\n{"body": "b"}\n', ":2: no key 'text'"),
    ('{"text": 7}\n', ":1: key 'text' holds int, expected a string"),
])
def test_bad_input_one_error_line(corpus, tmp_path, capsys, content, needle):
    _, _, flags, _ = corpus
    path = tmp_path / "in.jsonl"
    path.write_text(content)
    assert preprocess_data.main(["--input", str(path), "--output-prefix", str(tmp_path / "o")] + flags) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {path}") and needle in err, err
    assert not list(tmp_path.glob("o_*")) and not list(tmp_path.glob(".preprocess-*"))


def test_bad_setup_one_error_line(corpus, tmp_path, capsys):
    _, jsonl, _, _ = corpus
    for args, needle in [(["--input", str(tmp_path / "nope.jsonl"), "--tokenizer-type", "ByteTokenizer"],
                          "nope.jsonl: input file not found"),
                         (["--input", str(jsonl), "--tokenizer-type", "GPT2BPETokenizer"], "needs a vocab file"),
                         (["--input", str(tmp_path / "x.xml"), "--tokenizer-type", "ByteTokenizer"], "x.xml")]:
        (tmp_path / "x.xml").write_text("<a/>")
        assert preprocess_data.main(args + ["--output-prefix", str(tmp_path / "o")]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and needle in err, err


def test_cli_exit_code_with_workers(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(30)) + "oops\n")
    run = subprocess.run([sys.executable, TOOL, "--input", str(path), "--output-prefix", str(tmp_path / "o"),
                          "--tokenizer-type", "ByteTokenizer", "--workers", "2", "--no-progress"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and run.stderr.strip().splitlines() == [f"error: {path}:31: not valid JSON "
                                                                       "(Expecting value: line 1 column 1 (char 0))"]
