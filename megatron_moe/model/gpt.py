"""GPT-MoE: embedding -> transformer layers (dense or MoE FFN) -> final norm -> vocab-parallel logits.

GPT-2 shape by default (learned positions, LayerNorm, GeLU, biases, tied embeddings); with
`rmsnorm + swiglu + rope + bias: false` it is Mixtral-shaped. Logits stay vocab-parallel
`[b, s, V_padded/tp]`; the loss is the vocab-parallel cross-entropy (fp32) and never sees padded
vocabulary entries. Parameters are initialized from `training.seed` independently of the layout.
Under pipeline parallelism a rank holds its stage's model chunks (model/pipeline_stages.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron_moe.config.schema import Config
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.output import ModelOutput
from megatron_moe.model.pipeline_stages import StagedModel
from megatron_moe.tensor_parallel import (ColumnParallelLinear, copy_to_tp_region, gather_from_tp_region,
                                          padded_vocab_size, vocab_parallel_cross_entropy)


class GPTMoEModel(StagedModel):
    def __init__(self, cfg: Config, state: ParallelState):
        m = cfg.model
        super().__init__(cfg, state, causal=True, tied_head=m.tie_embeddings)
        self.output = None  # tied: logits use the word embedding
        if self.stage.has_head and not m.tie_embeddings:
            self.output = ColumnParallelLinear(m.hidden_size, padded_vocab_size(m.vocab_size, state.tp_size), state,
                                               bias=False, std=m.init_std, valid_rows=m.vocab_size)
        self.finish_init()

    def forward(self, tokens: torch.Tensor, labels: Optional[torch.Tensor] = None,
                loss_mask: Optional[torch.Tensor] = None, *, chunk: int = 0,
                hidden: Optional[torch.Tensor] = None) -> ModelOutput:
        """tokens, labels `[b, s]` (replicated across TP); loss_mask `[b, s]` (1 = counts). With
        pipeline stages: virtual chunk `chunk` of this stage on `hidden` [b, s, h] from the previous
        stage (not for the first chunk); a chunk before the last returns its output as `hidden`."""
        x, aux_loss, moe_stats = self.run_chunk(chunk, hidden, lambda: self.embedding(tokens))  # [b, s, h]
        if not self.stage.is_last(chunk):
            return ModelOutput(None, None, aux_loss, moe_stats, hidden=x)
        logits = self._logits(self.final_norm(x))  # [b, s, V_padded/tp]
        if labels is None:
            return ModelOutput(logits, None, aux_loss, moe_stats)
        losses = vocab_parallel_cross_entropy(logits, labels, self.state.tp, self.cfg.model.vocab_size)  # [b, s]
        if loss_mask is None:
            lm_loss = losses.mean()
        else:
            loss_mask = loss_mask.float()
            lm_loss = (losses * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)
        return ModelOutput(None, lm_loss, aux_loss, moe_stats)
    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.output is not None:
            return self.output(x)
        return F.linear(copy_to_tp_region(x, self.state.tp), self.embedding.word.weight)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel `[b, s, V_padded/tp]` -> full `[b, s, vocab_size]` on every TP rank (evaluation, tests)."""
        return gather_from_tp_region(logits, self.state.tp)[..., : self.cfg.model.vocab_size]
