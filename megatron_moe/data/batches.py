"""Which samples each rank trains on: a function of (seed, global batch) only, never of the layout.

    global batch i        = samples [i*B, (i+1)*B) of the dataset (B = global_batch_size); the
                            datasets are already shuffled from the seed (gpt_dataset.py, blend.py)
    micro-batch j         = samples [j*mbs, (j+1)*mbs) of that list
    data-parallel rank d  = micro-batches j with j % dp == d

So 1 process runs micro-batches 0..M-1 and 4 data-parallel ranks run the same M micro-batches
between them; the gradient they sum is the same.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np
import torch

Batch = Dict[str, torch.Tensor]  # e.g. tokens Long[b, s], labels Long[b, s], loss_mask Float[b, s]


def global_batch(index: int, global_batch_size: int) -> List[int]:
    """Sample indices of global batch `index` (0-based)."""
    return list(range(index * global_batch_size, (index + 1) * global_batch_size))


def rank_micro_batches(samples: Sequence[int], micro_batch_size: int, dp_size: int,
                       dp_rank: int) -> List[List[int]]:
    """This data-parallel rank's micro-batches (j % dp_size == dp_rank) of one global batch."""
    micro = [list(samples[j: j + micro_batch_size]) for j in range(0, len(samples), micro_batch_size)]
    return micro[dp_rank::dp_size]


def collate(dataset, indices: Sequence[int]) -> Batch:
    """Stack dataset samples (dicts of numpy arrays) into batch-first tensors."""
    samples = [dataset[i] for i in indices]
    return {key: torch.from_numpy(np.stack([s[key] for s in samples])) for key in samples[0]}
