"""`data.path` mistakes say what to write (issue #43 item 8): a `.bin` / `.idx` given by mistake is
dropped with a note, a raw corpus points to tools/preprocess_data.py, a missing prefix says that a
prefix has no extension (and names the dataset preprocess_data wrote from it); too small a
`model.vocab_size` names the padded size to use (item 7)."""
import numpy as np
import pytest

from megatron_moe.config import ConfigError, load_config
from megatron_moe.data.datasets import build_gpt_datasets_from_config, validate_data_config
from megatron_moe.data.indexed import IndexedDatasetBuilder

TOK = ["data.tokenizer.type=ByteTokenizer", "model.vocab_size=261", "model.seq_length=16", "data.split=90,10,0",
       "training.train_iters=2", "training.global_batch_size=2", "training.eval_iters=1"]


@pytest.fixture()
def prefix(tmp_path):
    """my_text_document, as `preprocess_data.py --output-prefix my` names it."""
    p = str(tmp_path / "my_text_document")
    builder = IndexedDatasetBuilder(p, dtype=np.uint16)
    for i in range(20):
        builder.add_document(list(range(i, i + 30)) + [260], [31])
    builder.finalize()
    return p


def error(overrides):
    with pytest.raises(ConfigError) as e:
        validate_data_config(load_config(None, overrides))
    message = str(e.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("ext", [".bin", ".idx"])
def test_a_file_name_given_for_the_prefix_is_stripped_with_a_note(prefix, tmp_path, capsys, ext):
    cfg = load_config(None, TOK + [f"data.path=[{prefix}{ext}]", f"data.cache_dir={tmp_path}"])
    assert validate_data_config(cfg) == 261
    assert cfg.data.path == [prefix]  # what the run (and its checkpoints) read from here on
    out = capsys.readouterr().out
    assert out == ("note: data.path names a dataset by its prefix, without .bin / .idx: reading "
                   f"{prefix}{ext} -> {prefix}\n")
    train, _ = build_gpt_datasets_from_config(cfg)
    reference = load_config(None, TOK + [f"data.path=[{prefix}]", f"data.cache_dir={tmp_path}"])
    assert train[0]["tokens"].tolist() == build_gpt_datasets_from_config(reference)[0][0]["tokens"].tolist()
    # a weighted blend keeps its weights; a string keeps working
    cfg = load_config(None, TOK + [f"data.path=0.5 {prefix}.bin 0.5 {prefix}"])
    validate_data_config(cfg)
    assert cfg.data.path == [0.5, prefix, 0.5, prefix]


def test_missing_and_raw_inputs_say_what_to_write(prefix, tmp_path):
    d = tmp_path
    message = error(TOK + [f"data.path=[{d}/nope.bin]"])
    assert message == (f"data.path: {d}/nope.bin: no dataset {d}/nope ({d}/nope.bin and {d}/nope.idx not found; "
                       "a dataset is named by its prefix, without .bin / .idx)")
    for name in ("corpus.jsonl", "corpus.txt"):
        (d / name).write_text('{"text": "hello"}\n')
        message = error(TOK + [f"data.path=[{d}/{name}]"])
        assert message == (f"data.path: {d}/{name} is a raw corpus, not a preprocessed dataset: tokenize it with "
                           f"`python tools/preprocess_data.py --input {d}/{name} --output-prefix {d}/corpus "
                           f"--tokenizer-type ... --append-eod` and set data.path to the prefix it prints "
                           f"({d}/corpus_text_document)")
    message = error(TOK + [f"data.path=[{d}/my]"])  # the --output-prefix instead of the dataset it wrote
    assert message == (f"{d}/my.idx: file not found (my.bin is missing too): data.path names a dataset by its "
                       f"prefix, without .bin / .idx, as tools/preprocess_data.py prints it; did you mean {prefix}?")
    message = error(TOK + [f"data.path=[{d}/other]"])
    assert message.endswith("as tools/preprocess_data.py prints it")


def test_too_small_vocab_names_the_padded_size(prefix):
    message = error(TOK[:1] + ["model.vocab_size=100", f"data.path=[{prefix}]"])
    assert message == ("model.vocab_size=100 is smaller than the tokenizer's 261 tokens (data.tokenizer.type="
                       "ByteTokenizer); set model.vocab_size=384 (the next multiple of 128, as Megatron-LM pads; "
                       "docs/data.md)")
