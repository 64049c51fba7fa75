"""GPT pretraining samples from an indexed dataset, with Megatron-LM's semantics.

The documents of a split are concatenated into one token stream, epoch after epoch, each epoch in
its own order (a permutation drawn from (seed, epoch)). Sample i is stream tokens
[i*L, i*L + L] (L = seq_length, so L + 1 tokens, crossing document boundaries; consecutive samples
share one token); `tokens` are the first L, `labels` the last L. Samples are read in a shuffled
order: the samples that start in epoch e are permuted among themselves (drawn from (seed, epoch)).

Everything is a function of the seed and the sample index only: asking for more samples adds
epochs at the end and changes nothing before them, and nothing depends on the parallel layout.
The three index arrays are cached next to the data (`<prefix>.<hash>.gpt_*.npy`).
"""
from __future__ import annotations

import os
import re
from typing import Dict, List, Optional, Tuple

import numpy as np

from megatron_moe.data.cache import cached_arrays
from megatron_moe.data.indexed import IndexedDataset

Sample = Dict[str, np.ndarray]  # tokens int64[L], labels int64[L], loss_mask float32[L]


def parse_split(split: str) -> List[float]:
    """"969,30,1" (or "90/5/5", "1") -> normalized train/valid/test weights (Megatron-LM's rule)."""
    weights = [float(w) for w in re.findall(r"[.0-9]+", split)]
    if not weights or len(weights) > 3 or sum(weights) <= 0:
        raise ValueError(f"data.split={split!r}: give up to three non-negative weights, e.g. '969,30,1'")
    weights += [0.0] * (3 - len(weights))
    return [w / sum(weights) for w in weights]


def split_ranges(num_documents: int, weights: List[float]) -> List[Tuple[int, int]]:
    """Contiguous document ranges per split, rounded as Megatron-LM's get_split_indices does."""
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w * float(num_documents))))
    diff = bounds[-1] - num_documents
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    return list(zip(bounds[:-1], bounds[1:]))


def document_token_starts(data: IndexedDataset) -> np.ndarray:
    """int64[documents + 1]: token offset in `.bin` where each document starts (its sequences are
    consecutive); the last entry is the total token count."""
    seq_starts = np.zeros(len(data) + 1, np.int64)
    np.cumsum(data.sequence_lengths, dtype=np.int64, out=seq_starts[1:])
    return seq_starts[data.document_indices]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _rng(seed: int, epoch: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch, stream])  # stream 0: documents, 1: samples


class GPTDataset:
    """`ds[i] -> {"tokens", "labels", "loss_mask"}` (numpy: int64, int64, float32; length seq_length).
    `len(ds)` covers whole epochs and is at least `num_samples`."""

    def __init__(self, data: IndexedDataset, documents: Tuple[int, int], seq_length: int, num_samples: int,
                 seed: int, cache_dir: Optional[str] = None, name: str = "train"):
        if seq_length < 1:
            raise ValueError(f"model.seq_length must be >= 1 (got {seq_length})")
        self.data, self.seq_length, self.seed = data, seq_length, seed
        self.doc_starts = document_token_starts(data)  # [D + 1]
        doc_ids = np.arange(*documents, dtype=np.int64)
        doc_lengths = self.doc_starts[doc_ids + 1] - self.doc_starts[doc_ids]
        tokens_per_epoch = int(doc_lengths.sum())
        if tokens_per_epoch == 0:
            raise ValueError(f"{data.prefix}: the {name} split (documents {documents[0]}..{documents[1]}) has no tokens")
        # fewest epochs holding num_samples samples: ceil(E * T / L) >= num_samples
        num_epochs = max(1, (num_samples - 1) * seq_length // tokens_per_epoch + 1)
        idx = os.stat(data.prefix + ".idx")
        description = {"class": "GPTDataset", "version": 1, "prefix": os.path.abspath(data.prefix),
                       "idx_size": idx.st_size, "idx_mtime_ns": idx.st_mtime_ns, "documents": list(documents),
                       "seq_length": seq_length, "seed": seed, "num_epochs": num_epochs}
        directory = cache_dir or os.path.dirname(os.path.abspath(data.prefix))
        stem = f"{os.path.basename(data.prefix)}.{name}"
        arrays = cached_arrays(directory, stem, description, lambda: self._build_indices(
            doc_ids, doc_lengths, tokens_per_epoch, num_epochs))
        self.document_index = arrays["document_index"]  # [documents in stream order]
        self.sample_index = arrays["sample_index"]  # [samples + 1, 2]: (stream document, token offset)
        self.shuffle_index = arrays["shuffle_index"]  # [samples]

    def _build_indices(self, doc_ids: np.ndarray, doc_lengths: np.ndarray, tokens_per_epoch: int,
                       num_epochs: int) -> Dict[str, np.ndarray]:
        self._check_contiguous()
        L = self.seq_length
        # Extra epochs so the samples that start in the last epoch find their L following tokens.
        stream_epochs = num_epochs + _ceil_div(L, tokens_per_epoch)
        order = [_rng(self.seed, e, 0).permutation(len(doc_ids)) for e in range(stream_epochs)]
        document_index = np.concatenate([doc_ids[o] for o in order])
        stream_starts = np.zeros(len(document_index) + 1, np.int64)
        np.cumsum(np.concatenate([doc_lengths[o] for o in order]), out=stream_starts[1:])
        num_samples = _ceil_div(num_epochs * tokens_per_epoch, L)
        positions = np.arange(num_samples + 1, dtype=np.int64) * L  # sample i spans positions[i]..positions[i+1]
        # The last document starting at or before each position holds it (skips empty documents).
        doc = np.searchsorted(stream_starts, positions, side="right") - 1
        sample_index = np.stack([doc, positions - stream_starts[doc]], axis=1)
        shuffle = []
        for e in range(num_epochs):
            lo, hi = _ceil_div(e * tokens_per_epoch, L), _ceil_div((e + 1) * tokens_per_epoch, L)
            shuffle.append(lo + _rng(self.seed, e, 1).permutation(hi - lo))
        return {"document_index": document_index, "sample_index": sample_index,
                "shuffle_index": np.concatenate(shuffle)}

    def _check_contiguous(self) -> None:
        lengths, pointers = self.data.sequence_lengths, self.data.sequence_pointers
        expected = np.zeros(len(lengths), np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=expected[1:])
        if not np.array_equal(pointers, expected * self.data.dtype.itemsize):
            raise ValueError(f"{self.data.prefix}.idx: sequences are not stored back to back in the .bin")

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def __getitem__(self, i: int) -> Sample:
        j = int(self.shuffle_index[i])
        (doc0, off0), (doc1, off1) = self.sample_index[j], self.sample_index[j + 1]
        pieces = []
        for k in range(int(doc0), int(doc1) + 1):
            start = int(self.doc_starts[self.document_index[k]])
            lo = int(off0) if k == doc0 else 0
            hi = int(off1) + 1 if k == doc1 else int(self.doc_starts[self.document_index[k] + 1]) - start
            pieces.append(self.data.read_tokens(start + lo, hi - lo))
        text = np.concatenate(pieces).astype(np.int64)  # [L + 1]
        return {"tokens": text[:-1], "labels": text[1:], "loss_mask": np.ones(self.seq_length, np.float32)}
