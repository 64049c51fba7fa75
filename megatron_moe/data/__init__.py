"""Training data. For now only the embedded demo corpus (`data.path: null`); the indexed-dataset
pipeline of a later issue plugs in behind `build_datasets`."""
from __future__ import annotations

from typing import Tuple

from megatron_moe.config.errors import ConfigError
from megatron_moe.config.schema import Config
from megatron_moe.data.batches import GlobalBatchSampler, collate, rank_micro_batches
from megatron_moe.data.demo_corpus import VOCAB_SIZE, TokenSamples, demo_datasets


def check_data_config(cfg: Config) -> None:
    """Data rules that must hold before any process group exists (ConfigError otherwise)."""
    if cfg.data.path is not None:
        raise ConfigError("data.path: indexed datasets are not supported yet; "
                          "use data.path=null for the embedded demo corpus")
    if cfg.model.vocab_size < VOCAB_SIZE:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the demo corpus's "
                          f"{VOCAB_SIZE} byte tokens")


def build_datasets(cfg: Config) -> Tuple[TokenSamples, TokenSamples]:
    """(train, valid) datasets; each has `len()` and `[i] -> (tokens, labels, loss_mask)`."""
    check_data_config(cfg)
    return demo_datasets(cfg.model.seq_length, cfg.data.split)


__all__ = ["GlobalBatchSampler", "build_datasets", "check_data_config", "collate", "rank_micro_batches"]
