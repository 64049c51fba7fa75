"""Embedded demo data: a byte-level token stream (vocab 256) cut from the Python standard
library's own `.py` sources. No files to prepare, nothing to download.

Documents are the stdlib's `.py` files in sorted relative-path order (without `site-packages` and
the code-page tables of `encodings/`), up to `MAX_BYTES` in all, cached in memory. `data.split`
(Megatron's "train,valid,test" weights) assigns whole documents to the splits, spread evenly over
the alphabet (document i goes where frac(i * golden ratio) falls). A split's documents are
concatenated; its sample i is tokens [i*s, i*s + s + 1), i.e. `s` inputs and the `s` next-byte labels.

A later issue replaces this with a tokenizer + indexed dataset behind the same small interface:
`len(dataset)` and `dataset[i] -> (tokens, labels, loss_mask)`.
"""
from __future__ import annotations

import functools
import math
import sysconfig
from pathlib import Path
from typing import Iterator, List, Tuple

import torch

from megatron_moe.config.errors import ConfigError

VOCAB_SIZE = 256  # bytes
MAX_BYTES = 4 << 20
SKIPPED_DIRS = ("site-packages", "encodings")
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


def _sources(directory: Path) -> Iterator[Path]:
    """`.py` files under `directory` in sorted relative-path order, lazily (a directory `d` sorts
    as "d/", exactly where its files fall in a sort of full paths)."""
    entries = sorted(directory.iterdir(), key=lambda p: p.name + ("/" if p.is_dir() else ""))
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            if entry.name not in SKIPPED_DIRS:
                yield from _sources(entry)
        elif entry.suffix == ".py" and entry.is_file():
            yield entry


@functools.lru_cache(maxsize=None)
def corpus_documents(max_bytes: int = MAX_BYTES) -> Tuple[bytes, ...]:
    """The stdlib source files' bytes, in a fixed order, at most `max_bytes` in all."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: List[bytes] = []
    total = 0
    for path in _sources(root):
        if total >= max_bytes:
            break
        data = path.read_bytes()[: max_bytes - total]
        docs.append(data)
        total += len(data)
    if total == 0:
        raise RuntimeError(f"no Python sources found under {root} for the demo corpus")
    return tuple(docs)


def split_tokens(split: str) -> List[torch.Tensor]:
    """[train, valid, test] token streams (Long[n] each) of the corpus under `data.split`."""
    bounds = [0.0]
    for frac in split_fractions(split):
        bounds.append(bounds[-1] + frac)
    parts: List[List[bytes]] = [[], [], []]
    for i, doc in enumerate(corpus_documents()):
        pos = (i * _GOLDEN) % 1.0
        parts[next((k for k in range(3) if pos < bounds[k + 1]), 2)].append(doc)
    return [torch.tensor(bytearray(b"".join(p)), dtype=torch.uint8).long() for p in parts]


class TokenSamples:
    """Fixed-length next-token samples from a token stream: sample i = stream[i*s : i*s + s + 1]."""

    def __init__(self, tokens: torch.Tensor, seq_length: int):
        self.tokens = tokens  # Long[n]
        self.seq_length = seq_length

    def __len__(self) -> int:
        return max(0, (self.tokens.numel() - 1) // self.seq_length)

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        start = index * self.seq_length
        window = self.tokens[start: start + self.seq_length + 1]  # [s + 1]
        return window[:-1], window[1:], torch.ones(self.seq_length)


def split_fractions(split: str) -> List[float]:
    """'969,30,1' -> [0.969, 0.03, 0.001] (train, valid, test weights, normalized)."""
    try:
        weights = [float(w) for w in split.split(",")]
    except ValueError:
        raise ConfigError(f"data.split={split!r} must be comma-separated numbers like 969,30,1") from None
    weights = (weights + [0.0, 0.0, 0.0])[:3]
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"data.split={split!r} needs non-negative weights with a positive sum")
    return [w / sum(weights) for w in weights]


def demo_datasets(seq_length: int, split: str) -> Tuple[TokenSamples, TokenSamples]:
    """(train, valid) sample sets over the embedded corpus."""
    train_tokens, valid_tokens, _ = split_tokens(split)
    train, valid = TokenSamples(train_tokens, seq_length), TokenSamples(valid_tokens, seq_length)
    if len(train) == 0 or len(valid) == 0:
        raise ConfigError(f"data.split={split!r} leaves no train or no valid samples of "
                          f"model.seq_length={seq_length} in the demo corpus")
    return train, valid
