"""Issue #46 item 1: the tokenizer travels with every checkpoint and export. A checkpoint carries a
copy of its training tokenizer (self-contained: moved, the sources deleted, it still has it),
conversions keep it, import-hf copies an HF directory's, and `AutoTokenizer.from_pretrained(export)`
encodes exactly as training did, for every tokenizer type the data pipeline has."""
import functools
import json
import os
import shutil

import pytest
import torch

from megatron_moe.config import load_config
from megatron_moe.convert import offline
from megatron_moe.data import embedded_corpus
from megatron_moe.data.tokenizer_training import train_bpe, train_sentencepiece
from megatron_moe.data.tokenizers import TokenizerSpec
from megatron_moe.convert.hf_tokenizer import extra_specials
from megatron_moe.training.checkpoint_tokenizer import checkpoint_tokenizer_spec, load_checkpoint_tokenizer
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.inference import build_single_process_model
from megatron_moe.training.checkpoint import checkpoint_tokenizer_dir
from megatron_moe.training.checkpoint_files import verify_manifest
from megatron_moe.training.failures import CheckpointError
from megatron_moe.training.trainer import Trainer
from tests.checkpoint_helpers import mixtral_config

transformers = pytest.importorskip("transformers")

CORPUS = ["hello world, this is a tiny corpus.\n\tindented   spaces  and\n\nblank lines",
          "def foo(x):\n    return x + 1  # comment\n", "héllo wörld 日本語 🙂 naïve café ünïcödé"] * 40
SAMPLE = ["hello  world\n\n  x", "héllo 🙂 日本語\t\t end ", "   leading", "trailing   ", "",
          "ünïcödé ∑ 𝔘 \u00a0nbsp \r\n", "def f():\n\treturn 1\r\n",
          "a<|endoftext|>b [PAD] c <EOD> [CLS] [EOS] <PAD> d"]  # specials' text: as training reads it
LOSSLESS = {"gpt2", "hf", "sentencepiece", "unigram", "bytes"}  # decode(encode(text)) == text
SHAPE = ["model.vocab_size=512", "model.seq_length=16", "model.num_layers=1"]


def _sources(kind: str, d: str) -> TokenizerSpec:
    """Tokenizer files of `kind`, built locally in `d` (no downloads)."""
    if kind in ("gpt2", "hf"):
        files = train_bpe(d, 400, texts=CORPUS, special_tokens=("<|endoftext|>",) if kind == "gpt2" else
                          ("<|endoftext|>", "[CLS]", "[SEP]", "[MASK]", "[PAD]"))
        if kind == "gpt2":
            return TokenizerSpec("GPT2BPETokenizer", files["vocab_file"], files["merge_file"])
        with open(os.path.join(d, "special_tokens_map.json"), "w") as f:
            json.dump({"eos_token": "<|endoftext|>", "bos_token": {"content": "<|endoftext|>"}}, f)
        return TokenizerSpec("HuggingFaceTokenizer", tokenizer_model=d)  # the directory form
    if kind in ("sentencepiece", "unigram"):
        model = train_sentencepiece(os.path.join(d, "spm"), 300, texts=CORPUS,
                                    model_type="bpe" if kind == "sentencepiece" else "unigram")
        return TokenizerSpec("SentencePieceTokenizer", tokenizer_model=model)
    if kind == "bert":
        with open(os.path.join(d, "vocab.txt"), "w") as f:
            f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world", "##s", "x", "a", "b",
                               "c", "h", "##e", "##l", "##o", ",", ".", "def", "f", "(", ")", ":"]) + "\n")
        return TokenizerSpec("BertWordPieceLowerCase", os.path.join(d, "vocab.txt"))
    return TokenizerSpec("ByteTokenizer")


@functools.lru_cache(maxsize=None)
def _weights():
    model = build_single_process_model(load_config("configs/mixtral_tiny.yaml", SHAPE))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_same(kind: str, ours, hf, texts=SAMPLE) -> None:
    """`hf` (AutoTokenizer) encodes and decodes every text as `ours` (the pipeline's tokenizer)."""
    if kind == "bert":  # BERT matches its own specials' text, not the appended [EOS]'s; the export matches both
        texts = [t.replace(" [EOS]", "") for t in texts]
    for text in texts:
        ids = ours.tokenize(text)
        assert hf(text)["input_ids"] == ids, (kind, text)
        assert hf.decode(ids) == ours.detokenize(ids), (kind, text)
        if kind in LOSSLESS:
            assert hf.decode(ids) == text, (kind, text)
    assert hf.eos_token_id == ours.eod and hf.pad_token_id == ours.pad and len(hf) == ours.vocab_size
    for role, i in ours.special_ids.items():  # every special id is its token, appended ones included
        assert hf.convert_ids_to_tokens(i) == ours.special_texts[role], (kind, role)


def _assert_prefix_token(spec, tok, hf) -> None:
    """The export declares the bos `extra_specials` finds, and the lm-eval backend's prefix token is
    the one lm-eval's `hf` backend takes from the export (its bos, else its eos)."""
    assert extra_specials(spec, tok).get("bos_token") == hf.bos_token
    try:
        from megatron_moe.evaluation.lm_eval_model import prefix_token
    except ImportError:  # lm-eval is an optional extra
        return
    assert prefix_token(spec, tok) == (hf.eos_token_id if hf.bos_token_id is None else hf.bos_token_id)


def _export_and_check(kind, ckpt, spec_tokenizer, out):
    offline.export_hf(ckpt, out)
    offline.export_hf(ckpt, out)  # an export of ours (tokenizer files included) is replaced without --force
    hf = transformers.AutoTokenizer.from_pretrained(out)
    _assert_same(kind, spec_tokenizer, hf)
    gen = json.load(open(os.path.join(out, "generation_config.json")))
    assert gen["eos_token_id"] == spec_tokenizer.eod and gen["pad_token_id"] == spec_tokenizer.pad
    return hf


@pytest.mark.parametrize("kind", ["gpt2", "sentencepiece", "unigram", "hf", "bert", "bytes"])
def test_checkpoint_carries_tokenizer_and_export_encodes_as_training(kind, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    spec = _sources(kind, str(src))
    training = spec.build()
    cfg = mixtral_config(tmp_path, SHAPE)
    written = offline.write_model_checkpoint(str(tmp_path / "ckpt"), cfg, _weights(), tokenizer=spec)
    assert checkpoint_tokenizer_dir(written) is not None
    verify_manifest(written)  # the copies are in the manifest
    # self-contained: the sources gone, the checkpoint moved, its tokenizer is the training one
    shutil.rmtree(src)
    os.rename(tmp_path / "ckpt", tmp_path / "moved")
    moved = str(tmp_path / "moved")
    for path in (moved, os.path.join(moved, os.path.basename(written))):  # a root or one iter_* directory
        loaded = load_checkpoint_tokenizer(path)
        assert type(loaded) is type(training) and loaded.special_ids == training.special_ids
        assert [loaded.encode(t) for t in SAMPLE] == [training.tokenize(t) for t in SAMPLE]
    if kind == "hf":
        assert loaded.describe() == training.describe()  # its special_tokens_map.json came along
    hf = _export_and_check(kind, moved, training, str(tmp_path / "export"))
    _assert_prefix_token(checkpoint_tokenizer_spec(moved), loaded, hf)
    if kind == "sentencepiece":
        assert hf.bos_token_id == training._sp.bos_id()
        assert os.path.isfile(tmp_path / "export" / "tokenizer.model")
    # reshard keeps it; import-hf of the export copies the export's tokenizer into the new checkpoint
    resharded = offline.reshard(moved, str(tmp_path / "resharded"), 1, 2, 1)
    assert load_checkpoint_tokenizer(resharded).special_ids == training.special_ids
    imported = load_checkpoint_tokenizer(offline.import_hf(str(tmp_path / "export"), str(tmp_path / "imported")))
    plain = SAMPLE[:-1]  # not the literal specials: the imported tokenizer.json matches their text
    assert [imported.tokenize(t) for t in plain] == [training.tokenize(t) for t in plain]
    assert imported.eod == training.eod and imported.pad == training.pad
    # a damaged copy is refused, naming the file
    with open(os.path.join(resharded, "tokenizer", "tokenizer_spec.json"), "a") as f:
        f.write(" ")
    with pytest.raises(CheckpointError, match="tokenizer/tokenizer_spec.json"):
        load_checkpoint_tokenizer(resharded)


def test_embedded_default_run_checkpoint_and_export(tmp_path, monkeypatch):
    """A training run on the embedded corpus: its checkpoints carry the BPE trained for it, which
    still loads with the corpus cache deleted, and its export encodes as the run's tokenizer."""
    monkeypatch.setattr(embedded_corpus, "ensure_embedded_corpus",
                        functools.partial(embedded_corpus.ensure_embedded_corpus, max_bytes=150_000))
    cfg = mixtral_config(tmp_path, SHAPE + [
        "data.path=null", "data.embedded_vocab_size=512", f"data.cache_dir={tmp_path}/cache", "training.train_iters=1",
        "training.micro_batch_size=2", "training.global_batch_size=2", "training.eval_interval=0",
        "checkpoint.save_interval=1"])
    Trainer(cfg, ParallelState.single_process()).train()
    training = embedded_corpus.ensure_embedded_corpus(f"{tmp_path}/cache", vocab_size=512).tokenizer.build()
    document = embedded_corpus.collect_documents(20_000)[3]
    shutil.rmtree(tmp_path / "cache")
    loaded = load_checkpoint_tokenizer(str(tmp_path / "ckpt"))
    assert [loaded.tokenize(t) for t in SAMPLE + [document]] == [training.tokenize(t) for t in SAMPLE + [document]]
    hf = _export_and_check("gpt2", str(tmp_path / "ckpt"), training, str(tmp_path / "export"))
    assert hf(document)["input_ids"] == training.tokenize(document)


def test_export_without_a_tokenizer_says_so(tmp_path, capsys):
    """A checkpoint trained without a data pipeline (synthetic data): export writes no tokenizer and
    prints one line saying why."""
    offline.write_model_checkpoint(str(tmp_path / "ckpt"), mixtral_config(tmp_path, SHAPE), _weights())
    offline.export_hf(str(tmp_path / "ckpt"), str(tmp_path / "export"))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("export-hf: no tokenizer written:") and "carries no tokenizer" in err[0]
    assert not any(n.startswith(("tokenizer", "generation")) for n in os.listdir(tmp_path / "export"))
    with pytest.raises(ValueError, match="carries no tokenizer"):
        load_checkpoint_tokenizer(str(tmp_path / "ckpt"))
