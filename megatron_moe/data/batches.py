"""Which samples each rank trains on: a function of (seed, global batch) only, never of the layout.

    global batch i        = a fixed list of `global_batch_size` sample indices
                            (epoch e of the data is a permutation drawn from (seed, e))
    micro-batch j         = samples [j*mbs, (j+1)*mbs) of that list
    data-parallel rank d  = micro-batches j with j % dp == d

So 1 process runs micro-batches 0..M-1 and 4 data-parallel ranks run the same M micro-batches
between them; the gradient they sum is the same.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

Batch = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # tokens Long[b, s], labels Long[b, s], loss_mask [b, s]


class GlobalBatchSampler:
    """Global batch index -> sample indices, walking through epochs of the dataset."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int, shuffle: bool = True):
        assert num_samples > 0
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self._epoch: Optional[Tuple[int, torch.Tensor]] = None  # (epoch, permutation) cache

    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        if self._epoch is None or self._epoch[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._epoch = (epoch, torch.randperm(self.num_samples, generator=gen))
        return self._epoch[1]

    def batch(self, index: int) -> List[int]:
        """Sample indices of global batch `index` (0-based)."""
        out = []
        for k in range(index * self.global_batch_size, (index + 1) * self.global_batch_size):
            epoch, pos = divmod(k, self.num_samples)
            out.append(int(self._order(epoch)[pos]))
        return out


def rank_micro_batches(samples: Sequence[int], micro_batch_size: int, dp_size: int,
                       dp_rank: int) -> List[List[int]]:
    """This data-parallel rank's micro-batches (j % dp_size == dp_rank) of one global batch."""
    micro = [list(samples[j: j + micro_batch_size]) for j in range(0, len(samples), micro_batch_size)]
    return micro[dp_rank::dp_size]


def collate(dataset, indices: Sequence[int]) -> Batch:
    """Stack dataset samples into batch-first tensors."""
    tokens, labels, mask = zip(*(dataset[i] for i in indices))
    return torch.stack(tokens), torch.stack(labels), torch.stack(mask)
