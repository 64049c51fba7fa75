"""`data.*` -> the train and valid datasets the Trainer reads (GPT here; BERT in bert_dataset.py).

`data.path` set: Megatron-LM indexed prefixes, one or a weighted blend (blend.py).
`data.path: null`: the embedded corpus (embedded_corpus.py), built once into `data.cache_dir`.
Train needs `train_iters * global_batch_size` samples, valid `eval_iters * global_batch_size`
(every evaluation reads the same valid batches).
"""
from __future__ import annotations

from typing import List, Tuple

from megatron_moe.config.errors import ConfigError
from megatron_moe.config.schema import Config
from megatron_moe.config.validate import tokenizer_spec, validate_data_config
from megatron_moe.data.blend import data_path_items
from megatron_moe.data.tokenizers import TokenizerSpec


def data_source(cfg: Config, sentences: bool = False) -> Tuple[List, TokenizerSpec]:
    """(`data.path`-style list, tokenizer) for the configured data; `sentences` picks the embedded
    corpus's sentence-level dataset (BERT)."""
    validate_data_config(cfg)
    if cfg.data.path is not None:
        return data_path_items(cfg.data.path), tokenizer_spec(cfg)
    from megatron_moe.data.embedded_corpus import ensure_embedded_corpus

    corpus = ensure_embedded_corpus(cfg.data.cache_dir, vocab_size=cfg.data.embedded_vocab_size)
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
