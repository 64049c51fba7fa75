"""BERT-MoE: a bidirectional encoder (Devlin et al. 2019, §3) whose FFNs are MoE layers, with the
masked-LM head and the binary head of BERT pretraining, tensor-parallel as in Megatron-LM's BERT.

    x   = dropout(word[tokens] + position + token_type[token_types])           [b, s, h]
    x   = TransformerLayer(causal=False)(x, padding_mask)  x num_layers; final norm
    MLM = norm(gelu(dense(x))) @ word^T + bias       tied, vocab-parallel [b, s, V_padded/tp]
          -> vocab-parallel cross-entropy on the masked positions (loss_mask) = `lm_loss`
    bin = head(tanh(pooler(x[:, 0])))                [b, 2] on [CLS]; cross-entropy = `binary_loss`
          (sentence-order prediction, Lan et al. 2020 §4.1, or next-sentence prediction, BERT §3.1,
          per `model.binary_head`; none = no head)

Everything outside the vocabulary-parallel embedding/projection and the attention/FFN blocks is
replicated across TP; parameters are initialized from `training.seed` independently of the layout.
Under pipeline parallelism the embedding sits on the first stage and both heads on the last, with a
copy of the word table for the tied MLM projection (model/pipeline_stages.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron_moe.config.schema import Config
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.norm import build_norm
from megatron_moe.model.output import ModelOutput
from megatron_moe.tensor_parallel.param_meta import ParamMeta, make_param
from megatron_moe.model.pipeline_stages import StagedModel
from megatron_moe.tensor_parallel import (ReplicatedLinear, copy_to_tp_region, padded_vocab_size,
                                          vocab_parallel_cross_entropy)

NUM_TOKEN_TYPES = 2  # segment A, segment B


class BertMoEModel(StagedModel):
    def __init__(self, cfg: Config, state: ParallelState):
        m = cfg.model
        super().__init__(cfg, state, causal=False, num_token_types=NUM_TOKEN_TYPES)
        self.mlm_dense = self.mlm_norm = self.mlm_bias = self.pooler = self.binary_head = None
        self.has_binary_loss = m.binary_head != "none"
        if self.stage.has_head:
            # MLM head: transform, then the tied word embedding and a vocab-parallel bias
            self.mlm_dense = ReplicatedLinear(m.hidden_size, m.hidden_size, state, std=m.init_std)
            self.mlm_norm = build_norm(m, state)
            self.mlm_bias = make_param(ParamMeta("dense", (padded_vocab_size(m.vocab_size, state.tp_size),),
                                                 [(0, "tp")], init="zeros", role="bias"), state)
            if m.binary_head != "none":
                self.pooler = ReplicatedLinear(m.hidden_size, m.hidden_size, state, std=m.init_std)
                self.binary_head = ReplicatedLinear(m.hidden_size, 2, state, std=m.init_std)
        self.finish_init()

    def forward(self, tokens: torch.Tensor, token_types: torch.Tensor, padding_mask: torch.Tensor,
                labels: Optional[torch.Tensor] = None, loss_mask: Optional[torch.Tensor] = None,
                binary_labels: Optional[torch.Tensor] = None, *, chunk: int = 0,
                hidden: Optional[torch.Tensor] = None) -> ModelOutput:
        """tokens, token_types, padding_mask (1 = real token), labels, loss_mask (1 = masked position
        to predict) `[b, s]`, binary_labels `[b]`; all replicated across TP. `chunk`, `hidden`: as
        GPTMoEModel.forward (pipeline stages)."""
        x, aux_loss, moe_stats = self.run_chunk(chunk, hidden, lambda: self.embedding(tokens, token_types),
                                                padding_mask)  # [b, s, h]
        if not self.stage.is_last(chunk):
            return ModelOutput(None, None, aux_loss, moe_stats, hidden=x)
        x = self.final_norm(x)
        logits = self._mlm_logits(x)  # [b, s, V_padded/tp]
        binary_logits = None
        if self.binary_head is not None:
            binary_logits = self.binary_head(torch.tanh(self.pooler(x[:, 0]))).float()  # [b, 2]
        if labels is None:
            return ModelOutput(logits, None, aux_loss, moe_stats)
        losses = vocab_parallel_cross_entropy(logits, labels, self.state.tp, self.cfg.model.vocab_size)  # [b, s]
        mask = loss_mask.float() if loss_mask is not None else torch.ones_like(losses)
        lm_loss = (losses * mask).sum() / mask.sum().clamp(min=1.0)
        binary_loss = None
        if binary_logits is not None and binary_labels is not None:
            binary_loss = F.cross_entropy(binary_logits, binary_labels.long())
        return ModelOutput(None, lm_loss, aux_loss, moe_stats, binary_loss)

    def _mlm_logits(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mlm_norm(F.gelu(self.mlm_dense(x)))  # [b, s, h]
        return F.linear(copy_to_tp_region(h, self.state.tp), self.embedding.word.weight, self.mlm_bias)
