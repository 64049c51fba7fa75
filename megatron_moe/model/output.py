"""What a model's forward returns."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch


@dataclass
class ModelOutput:
    # vocab-parallel logits [b, s, V_padded/tp]; None when labels were given
    logits: Optional[torch.Tensor]
    # mean cross-entropy over tokens with loss_mask == 1 (fp32 scalar, identical on every TP rank); None without labels
    lm_loss: Optional[torch.Tensor]
    # sum over MoE layers of their coefficient-weighted aux + z losses (scalar; 0 without MoE layers)
    aux_loss: torch.Tensor
    # one `MoEStats` per MoE layer, in layer order
    moe_stats: List["MoEStats"] = field(default_factory=list)  # noqa: F821 - megatron_moe.moe.stats
    # BERT's binary head (sentence order / next sentence): mean cross-entropy; None for GPT
    binary_loss: Optional[torch.Tensor] = None
    # a pipeline chunk before the last: its output hidden states [b, s, h] for the next stage
    hidden: Optional[torch.Tensor] = None
    # multi-token prediction (model/mtp.py): 1/D sum of the D depths' mean cross-entropies (DeepSeek-V3
    # Eq. 25 without the weight training.mtp_loss_weight); None without MTP, labels or in evaluation
    mtp_loss: Optional[torch.Tensor] = None
