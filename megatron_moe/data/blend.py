"""Weighted blending of datasets (Megatron-LM's BlendedDataset) and the train/valid/test builder.

`data.path: [0.3, prefixA, 0.7, prefixB]` (or Megatron-LM's `--data-path` string
`"0.3 prefixA 0.7 prefixB"`) mixes two corpora 30/70. Blended sample i comes from the
dataset whose next sample is most overdue: dataset d's k-th sample is due at time (k + 1/2) / w_d,
and samples are taken in order of due time (ties: lower d first). After any n samples every
dataset has contributed w_d * n samples up to about one, and sample i's source never depends on
how many samples are asked for (a deterministic, vectorized form of Megatron-LM's greedy blending).
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np

from megatron_moe.data.cache import cached_arrays
from megatron_moe.data.gpt_dataset import GPTDataset, Sample, document_token_starts, parse_split, split_ranges
from megatron_moe.data.indexed import IndexedDataset

SPLIT_NAMES = ("train", "valid", "test")
_BLEND_ARRAYS = ("dataset_index", "dataset_sample_index")


DATA_PATH_FORMS = ("a prefix, a list of prefixes, or weight/prefix pairs ('w1 p1 w2 p2' or [w1, p1, w2, p2]), "
                   "as Megatron-LM's --data-path takes them")


def data_path_items(path: Union[str, Sequence[Union[str, float, int]]]) -> List[Union[str, float]]:
    """`data.path` in any of Megatron-LM's `--data-path` forms -> one flat list of prefixes and
    weights: one string holds whitespace-separated items ("prefix", "p1 p2", "w1 p1 w2 p2"), a list
    holds items; an item that reads as a number is a weight."""
    items = path.split() if isinstance(path, str) else path
    if not isinstance(items, (list, tuple)) or not all(
            isinstance(p, (str, int, float)) and not isinstance(p, bool) for p in items):
        raise ValueError(f"data.path={path!r} must be {DATA_PATH_FORMS}")
    out: List[Union[str, float]] = []
    for item in items:
        try:
            out.append(float(item))
        except ValueError:
            out.append(item)
    return out


def parse_blend(path) -> Tuple[List[str], Optional[List[float]]]:
    """`data.path` (`data_path_items`' forms) -> (prefixes, weights or None): [prefix] |
    [prefix1, prefix2, ...] | [w1, prefix1, w2, prefix2, ...]."""
    items = data_path_items(path)
    if not items:
        raise ValueError(f"data.path={path!r} is empty; it must be {DATA_PATH_FORMS}")
    if all(isinstance(p, str) for p in items):
        return items, None
    if len(items) % 2 or not all(isinstance(w, float) and isinstance(p, str)
                                 for w, p in zip(items[0::2], items[1::2])):
        raise ValueError(f"data.path={path!r}: expected weight, prefix pairs ([w1, p1, w2, p2, ...] or 'w1 p1 w2 p2')")
    weights = items[0::2]
    if min(weights) < 0 or sum(weights) <= 0:
        raise ValueError(f"data.path weights {weights} must be non-negative and not all zero")
    return list(items[1::2]), weights


def blend_indices(weights: Sequence[float], num_samples: int) -> Tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16[n], dataset_sample_index int64[n]) for blended samples 0..n-1."""
    w = np.asarray(weights, np.float64) / float(np.sum(weights))
    ids, ks, due = [], [], []
    for d in np.flatnonzero(w):
        k = np.arange(int(np.ceil(w[d] * num_samples + len(w) / 2)) + 1, dtype=np.int64)
        ids.append(np.full(len(k), d, np.int16))
        ks.append(k)
        due.append((k + 0.5) / w[d])
    ids, ks, due = np.concatenate(ids), np.concatenate(ks), np.concatenate(due)
    order = np.lexsort((ids, due))[:num_samples]
    return ids[order], ks[order]


class BlendedDataset:
    """`ds[i]` is sample `dataset_sample_index[i]` of `datasets[dataset_index[i]]`."""

    def __init__(self, datasets: Sequence[Optional[GPTDataset]], dataset_index: np.ndarray,
                 dataset_sample_index: np.ndarray):
        self.datasets = list(datasets)
        self.dataset_index, self.dataset_sample_index = dataset_index, dataset_sample_index

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> Sample:
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]


def build_gpt_datasets(path: Sequence[Union[str, float]], split: str, seq_length: int, seed: int,
                       num_samples: Sequence[int], cache_dir: Optional[str] = None) -> List[Optional[object]]:
    """[train, valid, test] datasets (None for an empty split or 0 samples) from `data.path` and
    `data.split`. Each prefix's documents are split into contiguous ranges; with several prefixes
    every split blends them with the same weights (by default, proportional to their tokens)."""
    prefixes, weights = parse_blend(path)
    data = [IndexedDataset(p) for p in prefixes]
    ranges = [split_ranges(d.num_documents, parse_split(split)) for d in data]
    out: List[Optional[object]] = []
    for s, name in enumerate(SPLIT_NAMES):
        n = int(num_samples[s])
        if n <= 0 or all(r[s][0] == r[s][1] for r in ranges):
            out.append(None)
            continue
        if len(data) == 1:
            out.append(GPTDataset(data[0], ranges[0][s], seq_length, n, seed, cache_dir, name))
            continue
        if weights is None:
            starts = [document_token_starts(d) for d in data]
            split_weights = [float(st[r[s][1]] - st[r[s][0]]) for st, r in zip(starts, ranges)]
        else:
            split_weights = weights
        directory = cache_dir or os.path.dirname(os.path.abspath(prefixes[0]))
        blend = cached_arrays(directory, "blend", {"class": "blend", "version": 1, "weights": split_weights,
                                                   "num_samples": n},
                              lambda: dict(zip(_BLEND_ARRAYS, blend_indices(split_weights, n))))
        needed = np.bincount(blend["dataset_index"], minlength=len(data))
        parts = [GPTDataset(d, r[s], seq_length, int(k), seed, cache_dir, name) if k else None
                 for d, r, k in zip(data, ranges, needed)]
        out.append(BlendedDataset(parts, *(blend[a] for a in _BLEND_ARRAYS)))
    return out
