"""GPT-MoE: embedding -> transformer layers (dense or MoE FFN) -> final norm -> vocab-parallel logits.

GPT-2 shape by default (learned positions, LayerNorm, GeLU, biases, tied embeddings); with
`rmsnorm + swiglu + rope + bias: false` it is Mixtral-shaped. Logits stay vocab-parallel
`[b, s, V_padded/tp]`; the loss is the vocab-parallel cross-entropy (fp32) and never sees padded
vocabulary entries. Parameters are initialized from `training.seed` independently of the layout.
Under pipeline parallelism a rank holds its stage's model chunks (model/pipeline_stages.py).
Multi-token prediction (`model.mtp_depth`, model/mtp.py) runs after the final norm on the last
stage in training forwards with labels; its loss comes back as `ModelOutput.mtp_loss`, its MoE
layers' aux losses in `aux_loss` and their stats after the main layers'.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron_moe.config.schema import Config
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.mtp import build_mtp, mtp_forward
from megatron_moe.model.output import ModelOutput
from megatron_moe.model.pipeline_stages import StagedModel
from megatron_moe.tensor_parallel import (ColumnParallelLinear, copy_to_tp_region, gather_from_tp_region,
                                          padded_vocab_size, vocab_parallel_cross_entropy)


class GPTMoEModel(StagedModel):
    def __init__(self, cfg: Config, state: ParallelState):
        m = cfg.model
        super().__init__(cfg, state, causal=True, tied_head=m.tie_embeddings or m.mtp_depth > 0)
        self.output = None  # tied: logits use the word embedding
        if self.stage.has_head and not m.tie_embeddings:
            self.output = ColumnParallelLinear(m.hidden_size, padded_vocab_size(m.vocab_size, state.tp_size), state,
                                               bias=False, std=m.init_std, valid_rows=m.vocab_size)
        if self.stage.has_head:
            self.mtp = build_mtp(cfg, state, self.dropout_rng, self.rotary)  # None without MTP
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
        x = self.final_norm(x)
        logits = self._logits(x)  # [b, s, V_padded/tp]
        if labels is None:
            return ModelOutput(logits, None, aux_loss, moe_stats)
        losses = self._token_losses(logits, labels)  # [b, s]
        if loss_mask is None:
            lm_loss = losses.mean()
        else:
            lm_loss = (losses * loss_mask.float()).sum() / loss_mask.float().sum().clamp(min=1.0)
        mtp_loss = None
        if self.mtp is not None and self.training:  # model/mtp.py: h_0 = the head's input x
            mtp_loss, mtp_aux, mtp_stats = mtp_forward(self.mtp, x, tokens, labels, loss_mask, self._embed_words,
                                                       lambda h, y: self._token_losses(self._logits(h), y))
            aux_loss, moe_stats = (aux_loss if mtp_aux is None else aux_loss + mtp_aux), moe_stats + mtp_stats
        return ModelOutput(None, lm_loss, aux_loss, moe_stats, mtp_loss=mtp_loss)

    def _token_losses(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel logits `[b, s, V_padded/tp]`, labels `[b, s]` -> cross-entropy `[b, s]` (fp32)."""
        return vocab_parallel_cross_entropy(logits, labels, self.state.tp, self.cfg.model.vocab_size)

    def _embed_words(self, tokens: torch.Tensor) -> torch.Tensor:
        """MTP's Emb: the shared word table (this stage's copy on the last stage) + embedding dropout `[b, s, h]`."""
        return self.embedding.dropout(self.embedding.word(tokens))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.output is not None:
            return self.output(x)
        return F.linear(copy_to_tp_region(x, self.state.tp), self.embedding.word.weight)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel `[b, s, V_padded/tp]` -> full `[b, s, vocab_size]` on every TP rank (evaluation, tests)."""
        return gather_from_tp_region(logits, self.state.tp)[..., : self.cfg.model.vocab_size]
