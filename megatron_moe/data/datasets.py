"""`data.*` -> the train and valid datasets the Trainer reads (GPT here; BERT in bert_dataset.py).

`data.path` set: Megatron-LM indexed prefixes, one or a weighted blend (blend.py).
`data.path: null`: the embedded corpus (embedded_corpus.py), built once into `data.cache_dir`.
Train needs `train_iters * global_batch_size` samples, valid `eval_iters * global_batch_size`
(every evaluation reads the same valid batches).
"""
from __future__ import annotations

import glob
import os
from typing import Callable, List, Optional, Tuple

from megatron_moe.config.errors import ConfigError
from megatron_moe.config.schema import Config
from megatron_moe.data.blend import data_path_items, parse_blend
from megatron_moe.data.gpt_dataset import parse_split
from megatron_moe.data import indexed
from megatron_moe.data.indexed import IndexedDataset
from megatron_moe.data.preprocess import DOCUMENT_FORMATS
from megatron_moe.data.tokenizers import TOKENIZERS, TokenizerSpec, recommended_vocab_size, record_training_tokenizer


def data_source(cfg: Config, sentences: bool = False) -> Tuple[List, TokenizerSpec]:
    """(`data.path`-style list, tokenizer) for the configured data; `sentences` picks the embedded
    corpus's sentence-level dataset (BERT)."""
    validate_data_config(cfg)
    if cfg.data.path is not None:
        record_training_tokenizer(cfg, tokenizer_spec(cfg))  # every checkpoint carries a copy
        return data_path_items(cfg.data.path), tokenizer_spec(cfg)
    from megatron_moe.data.embedded_corpus import ensure_embedded_corpus

    corpus = ensure_embedded_corpus(cfg.data.cache_dir, vocab_size=cfg.data.embedded_vocab_size)
    record_training_tokenizer(cfg, corpus.tokenizer)
    return [corpus.sentence_prefix if sentences else corpus.document_prefix], corpus.tokenizer


def sample_counts(cfg: Config) -> Tuple[int, int, int]:
    """(train, valid, test) samples a run reads."""
    tr = cfg.training
    evaluates = tr.eval_iters > 0 and tr.eval_interval > 0
    return tr.train_iters * tr.global_batch_size, evaluates * tr.eval_iters * tr.global_batch_size, 0


def check_splits(cfg: Config, train, valid) -> None:
    train_n, valid_n, _ = sample_counts(cfg)
    for name, n, ds in (("train", train_n, train), ("valid", valid_n, valid)):
        if n and ds is None:
            raise ConfigError(f"data.split={cfg.data.split!r} leaves the {name} split without documents"
                              + ("; set training.eval_iters=0 to train without evaluation" if name == "valid" else ""))


def build_gpt_datasets_from_config(cfg: Config):
    """(train, valid) GPT datasets; `ds[i]` -> {tokens, labels, loss_mask} (valid None without evaluation)."""
    from megatron_moe.data.blend import build_gpt_datasets

    path, _ = data_source(cfg)
    try:
        train, valid, _ = build_gpt_datasets(path, cfg.data.split, cfg.model.seq_length, cfg.training.seed,
                                             sample_counts(cfg), cfg.data.cache_dir)
    except ValueError as exc:
        raise ConfigError(str(exc).splitlines()[0]) from None
    check_splits(cfg, train, valid)
    return train, valid


def validate_data_config(cfg: Config, note: Optional[Callable[[str], None]] = print) -> int:
    """Data rules (they read the tokenizer files and the `.idx` headers, so they run in the entry
    points, not in `validate_config`). Returns the tokenizer's vocabulary size. `note` gets the
    line saying a `data.path` item was corrected (`resolve_data_path`; None: silent)."""
    d = cfg.data
    try:
        parse_split(d.split)
        if not 0.0 < d.mask_prob < 1.0:
            raise ConfigError(f"data.mask_prob={d.mask_prob} must be in (0, 1)")
        if d.path is None:
            if d.tokenizer.type is not None:
                raise ConfigError("data.tokenizer.type is set but data.path is null: the embedded corpus "
                                  "brings its own tokenizer (set data.path to use yours)")
            if d.embedded_vocab_size < 512:
                raise ConfigError(f"data.embedded_vocab_size={d.embedded_vocab_size} must be >= 512")
            vocab_size, source = d.embedded_vocab_size, "data.embedded_vocab_size"
        else:
            resolve_data_path(cfg, note)
            for prefix in parse_blend(d.path)[0]:
                IndexedDataset(prefix)  # O(1): both files exist, header and sizes agree
            if d.tokenizer.type is None:
                raise ConfigError("data.path needs data.tokenizer.type (and its files) to know the vocabulary")
            vocab_size = tokenizer_spec(cfg).build().vocab_size
            source = f"data.tokenizer.type={d.tokenizer.type}"
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc).splitlines()[0]) from None
    if cfg.model.vocab_size < vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                          f"{vocab_size} tokens ({source}); set model.vocab_size={recommended_vocab_size(vocab_size)} "
                          "(the next multiple of 128, as Megatron-LM pads; docs/data.md)")
    return vocab_size


def resolve_data_path(cfg: Config, note: Optional[Callable[[str], None]] = print) -> None:
    """Each `data.path` prefix checked before it is opened: a `.bin` / `.idx` given by mistake is
    dropped (`cfg.data.path` rewritten, one line to `note`), a raw corpus (.jsonl, .txt, ...) or a
    prefix with neither file raises a one-line ValueError saying what to write instead."""
    parse_blend(cfg.data.path)  # its form first
    items = data_path_items(cfg.data.path)
    resolved = [item if isinstance(item, float) else _prefix(item) for item in items]
    if resolved == items:
        return
    cfg.data.path = resolved
    if note is not None:
        fixed = ", ".join(f"{a} -> {b}" for a, b in zip(items, resolved) if a != b)
        note(f"note: data.path names a dataset by its prefix, without .bin / .idx: reading {fixed}")


def _prefix(item: str) -> str:
    stem, ext = os.path.splitext(item)
    if indexed.exists(item) or os.path.isfile(indexed.bin_path(item)) or os.path.isfile(indexed.idx_path(item)):
        return item  # what the prefix names exists (IndexedDataset says if a file is missing or bad)
    if ext.lower() in (".bin", ".idx"):
        if os.path.isfile(indexed.bin_path(stem)) or os.path.isfile(indexed.idx_path(stem)):
            return stem
        raise ValueError(f"data.path: {item}: no dataset {stem} ({stem}.bin and {stem}.idx not found; a dataset is "
                         f"named by its prefix, without .bin / .idx{_near(stem)})")
    if ext.lower() in (".txt", *DOCUMENT_FORMATS):  # what tools/preprocess_data.py reads
        raise ValueError(f"data.path: {item} is a raw corpus, not a preprocessed dataset: tokenize it with "
                         f"`python tools/preprocess_data.py --input {item} --output-prefix {stem} --tokenizer-type ... "
                         f"--append-eod` and set data.path to the prefix it prints ({stem}_text_document)")
    raise ValueError(f"{indexed.idx_path(item)}: file not found ({os.path.basename(indexed.bin_path(item))} is "
                     f"missing too): data.path names a dataset by its prefix, without .bin / .idx, as "
                     f"tools/preprocess_data.py prints it{_near(item)}")


def _near(prefix: str) -> str:
    """`; did you mean P?` for a dataset tools/preprocess_data.py wrote from `--output-prefix prefix`."""
    found = sorted(p[:-4] for kind in ("document", "sentence")
                   for p in glob.glob(f"{glob.escape(prefix)}_*_{kind}.idx"))
    return f"; did you mean {' or '.join(found)}?" if found else ""


def tokenizer_spec(cfg: Config):
    """`data.tokenizer.*` as a `TokenizerSpec` (the registry checks the type)."""
    t = cfg.data.tokenizer
    TOKENIZERS.get(t.type)
    return TokenizerSpec(t.type, t.vocab_file, t.merge_file, t.model)
