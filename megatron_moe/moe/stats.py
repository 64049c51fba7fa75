"""Per-layer MoE statistics, refreshed by every `MoELayer.forward` (`layer.last_stats`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MoEStats:
    # Long[E]: routed (token, expert) assignments of this rank's data-parallel micro-batch, before drops
    tokens_per_expert: torch.Tensor
    # assignments of that micro-batch dropped by capacity (0 when dropless)
    dropped: int
    # Long[ep]: assignments actually computed by (each ESP shard of) every EP rank of this rank's
    # `ep_esp` group in this forward, after drops and placement; redundant copies included (the
    # baseline computes each TP rank's copy of a token)
    tokens_per_ep_rank: torch.Tensor

    @property
    def load_imbalance(self) -> float:
        """max / mean of `tokens_per_ep_rank` (1.0 = perfectly balanced or no tokens)."""
        load = self.tokens_per_ep_rank.double()
        mean = float(load.mean())
        return float(load.max()) / mean if mean > 0 else 1.0
