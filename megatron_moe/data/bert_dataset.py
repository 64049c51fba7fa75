"""BERT pretraining samples (Devlin et al. 2019 §3.1; Megatron-LM's BertDataset, simplified) from a
sentence-level indexed dataset (`preprocess_data.py --split-sentences`; the embedded corpus builds one).

Segments: each document of the split is cut greedily into runs of consecutive sentences holding at
least `seq_length - 3` tokens (the document's rest forms a last, shorter run); runs of fewer than
two sentences are dropped. Epoch e visits all segments in a permutation drawn from (seed, e).

Sample i (a pure function of seed and i, own generator (seed, i)):
    split its segment's sentences at a random point into A and B;
    sop: swap A and B with probability 1/2 (label 1 = swapped);
    nsp: with probability 1/2 B is the start of another random segment (label 1 = random next);
    truncate the longer of A, B from its end until [CLS] A [SEP] B [SEP] fits seq_length; pad.
    Masking: 15% (`data.mask_prob`) of the A/B tokens, at least one, are predicted; of those 80%
    become [MASK], 10% a random token, 10% stay.
Fields: tokens, token_types (0 = [CLS] A [SEP], 1 = B [SEP], 0 = padding), padding_mask (1 = real),
labels (original token at predicted positions, else 0), loss_mask (1 = predicted), binary_labels.
"""
from __future__ import annotations

import os
from typing import Dict, List, Tuple

import numpy as np

from megatron_moe.config.errors import ConfigError
from megatron_moe.config.schema import Config
from megatron_moe.data.blend import parse_blend
from megatron_moe.data.cache import cached_arrays
from megatron_moe.data.datasets import check_splits, data_source, sample_counts
from megatron_moe.data.gpt_dataset import parse_split, split_ranges
from megatron_moe.data.indexed import IndexedDataset
from megatron_moe.data.tokenizers import Tokenizer

Sample = Dict[str, np.ndarray]


def build_segments(data: IndexedDataset, documents: Tuple[int, int], target_tokens: int) -> np.ndarray:
    """int64[n, 2]: (first sentence, end sentence) of each segment of documents [lo, hi)."""
    lengths = data.sequence_lengths
    doc_index = data.document_indices
    out = []
    for d in range(*documents):
        start, end = int(doc_index[d]), int(doc_index[d + 1])
        first, tokens = start, 0
        for s in range(start, end):
            tokens += int(lengths[s])
            if tokens >= target_tokens or s == end - 1:
                if s + 1 - first >= 2:
                    out.append((first, s + 1))
                first, tokens = s + 1, 0
    return np.asarray(out, np.int64).reshape(-1, 2)


class BertDataset:
    """`ds[i]` -> BERT sample (numpy; see module doc). `len(ds)` = `num_samples`."""

    def __init__(self, data: IndexedDataset, documents: Tuple[int, int], tokenizer: Tokenizer, seq_length: int,
                 num_samples: int, seed: int, binary_head: str, mask_prob: float, cache_dir=None, name="train"):
        if seq_length < 8:
            raise ValueError(f"model.seq_length={seq_length} is too short for BERT sentence pairs (>= 8)")
        self.data, self.seq_length, self.seed = data, seq_length, seed
        self.binary_head, self.mask_prob, self.num_samples = binary_head, mask_prob, num_samples
        self.cls, self.sep, self.mask, self.pad, self.eod = (tokenizer.cls, tokenizer.sep, tokenizer.mask,
                                                             tokenizer.pad, tokenizer.eod)
        self.vocab_size = tokenizer.vocab_size
        self.special = np.array(sorted({self.cls, self.sep, self.mask, self.pad, self.eod}), np.int64)
        idx = os.stat(data.prefix + ".idx")
        description = {"class": "BertDataset", "version": 1, "prefix": os.path.abspath(data.prefix),
                       "idx_size": idx.st_size, "idx_mtime_ns": idx.st_mtime_ns, "documents": list(documents),
                       "seq_length": seq_length}
        directory = cache_dir or os.path.dirname(os.path.abspath(data.prefix))
        self.segments = cached_arrays(directory, f"{os.path.basename(data.prefix)}.{name}", description, lambda: {
            "segments": build_segments(data, documents, seq_length - 3)})["segments"]  # [n, 2]
        if len(self.segments) < 2:
            raise ValueError(f"{data.prefix}: the {name} split has {len(self.segments)} multi-sentence segments; "
                             "BERT needs sentence-split documents (preprocess_data.py --split-sentences)")
        self._order = (-1, None)  # (epoch, segment permutation) of the last epoch read

    def __len__(self) -> int:
        return self.num_samples

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch, 0]).permutation(len(self.segments)))
        return self._order[1]

    def _sentences(self, segment: int) -> List[np.ndarray]:
        first, end = self.segments[segment]
        out = []
        for s in range(int(first), int(end)):
            ids = np.asarray(self.data[s], np.int64)
            out.append(ids[:-1] if len(ids) > 1 and ids[-1] == self.eod else ids)
        return out

    def __getitem__(self, i: int) -> Sample:
        epoch, pos = divmod(int(i), len(self.segments))
        segment = int(self._epoch_order(epoch)[pos])
        rng = np.random.default_rng([self.seed, int(i), 1])
        sentences = self._sentences(segment)
        cut = int(rng.integers(1, len(sentences)))
        a, b = np.concatenate(sentences[:cut]), np.concatenate(sentences[cut:])
        label = 0
        if self.binary_head == "sop" and rng.random() < 0.5:
            a, b, label = b, a, 1
        elif self.binary_head == "nsp" and rng.random() < 0.5:
            other = (segment + 1 + int(rng.integers(len(self.segments) - 1))) % len(self.segments)
            b, label = np.concatenate(self._sentences(other)), 1
        a, b = truncate_pair(a, b, self.seq_length - 3)
        return self._masked(np.concatenate([[self.cls], a, [self.sep], b, [self.sep]]), len(a) + 2, rng, label)

    def _masked(self, ids: np.ndarray, len_first: int, rng: np.random.Generator, label: int) -> Sample:
        n, L = len(ids), self.seq_length
        candidates = np.flatnonzero(~np.isin(ids, self.special))  # A/B tokens (not [CLS]/[SEP])
        k = max(1, int(round(self.mask_prob * len(candidates))))
        chosen = np.sort(rng.choice(candidates, size=k, replace=False))
        labels = np.zeros(L, np.int64)
        labels[chosen] = ids[chosen]
        action = rng.random(k)  # < 0.8: [MASK]; 0.8..0.9: random token; else keep
        tokens = ids.copy()
        tokens[chosen[action < 0.8]] = self.mask
        swap = chosen[(action >= 0.8) & (action < 0.9)]
        tokens[swap] = rng.integers(0, self.vocab_size, size=len(swap))
        loss_mask = np.zeros(L, np.float32)
        loss_mask[chosen] = 1.0
        token_types = np.zeros(L, np.int64)
        token_types[len_first:n] = 1
        padding_mask = np.zeros(L, np.float32)
        padding_mask[:n] = 1.0
        return {"tokens": np.concatenate([tokens, np.full(L - n, self.pad, np.int64)]), "token_types": token_types,
                "padding_mask": padding_mask, "labels": labels, "loss_mask": loss_mask,
                "binary_labels": np.array(label, np.int64)}


def truncate_pair(a: np.ndarray, b: np.ndarray, max_tokens: int) -> Tuple[np.ndarray, np.ndarray]:
    """Drop tokens from the end of the longer of `a`, `b` until both fit in `max_tokens` (each keeps >= 1)."""
    over = len(a) + len(b) - max_tokens
    if over <= 0:
        return a, b
    la, lb = len(a), len(b)
    # remove from the longer one first: equalize, then alternate
    cut_a = min(over, max(0, la - lb))
    cut_b = min(over - cut_a, max(0, lb - la))
    rest = over - cut_a - cut_b
    cut_a, cut_b = cut_a + (rest + 1) // 2, cut_b + rest // 2
    return a[: la - cut_a], b[: lb - cut_b]


def build_bert_datasets_from_config(cfg: Config):
    """(train, valid) BERT datasets for `cfg` (sentence-level data: the embedded corpus's, or `data.path`)."""
    path, spec = data_source(cfg, sentences=True)
    prefixes, _ = parse_blend(path)
    if len(prefixes) != 1:
        raise ConfigError(f"data.path={path}: BERT reads one sentence-split prefix (blending is GPT-only for now)")
    tokenizer = spec.build()
    data = IndexedDataset(prefixes[0])
    ranges = split_ranges(data.num_documents, parse_split(cfg.data.split))
    out = []
    try:
        for (lo, hi), n, name in zip(ranges, sample_counts(cfg)[:2], ("train", "valid")):
            out.append(BertDataset(data, (lo, hi), tokenizer, cfg.model.seq_length, n, cfg.training.seed,
                                   cfg.model.binary_head, cfg.data.mask_prob, cfg.data.cache_dir, name)
                       if n and hi > lo else None)
    except ValueError as exc:
        raise ConfigError(str(exc).splitlines()[0]) from None
    check_splits(cfg, *out)
    return tuple(out)
