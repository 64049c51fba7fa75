"""GPT-MoE: embedding -> transformer layers (dense or MoE FFN) -> final norm -> vocab-parallel logits.

GPT-2 shape by default (learned positions, LayerNorm, GeLU, biases, tied embeddings); with
`rmsnorm + swiglu + rope + bias: false` it is Mixtral-shaped. Logits stay vocab-parallel
`[b, s, V_padded/tp]`; the loss is the vocab-parallel cross-entropy (fp32) and never sees padded
vocabulary entries. Parameters are initialized from `training.seed` independently of the layout.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F

from megatron_moe.config.schema import Config
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.embedding import Embedding
from megatron_moe.model.norm import build_norm
from megatron_moe.model.output import ModelOutput
from megatron_moe.model.param_meta import init_model_from_seed_
from megatron_moe.model.compile import compile_layers
from megatron_moe.model.transformer import TransformerLayer, moe_ffns, run_layers
from megatron_moe.moe import lancet, lancet_partition
from megatron_moe.tensor_parallel import (ColumnParallelLinear, DropoutRNG, copy_to_tp_region, gather_from_tp_region,
                                          padded_vocab_size, vocab_parallel_cross_entropy)


class GPTMoEModel(torch.nn.Module):
    def __init__(self, cfg: Config, state: ParallelState):
        super().__init__()
        m = cfg.model
        self.cfg, self.state = cfg, state
        self.dropout_rng = DropoutRNG(cfg.training.seed, state)
        self.embedding = Embedding(m, state, self.dropout_rng)
        self.layers = torch.nn.ModuleList(
            TransformerLayer(cfg, state, i, self.dropout_rng) for i in range(m.num_layers))
        self.final_norm = build_norm(m, state)
        self.output = None  # tied: logits use the word embedding
        if not m.tie_embeddings:
            self.output = ColumnParallelLinear(m.hidden_size, padded_vocab_size(m.vocab_size, state.tp_size), state,
                                               bias=False, std=m.init_std, valid_rows=m.vocab_size)
        init_model_from_seed_(self, cfg.training.seed, state)
        lancet.attach_from_config(self, cfg)  # moe.lancet.defer_wgrad
        if cfg.training.compile:
            compile_layers(self.layers)
        self.partitioner = lancet_partition.from_config(cfg, state, self.dropout_rng, self.layers)  # moe.lancet.partitions

    def moe_layers(self) -> List[torch.nn.Module]:
        return moe_ffns(self.layers)

    def forward(self, tokens: torch.Tensor, labels: Optional[torch.Tensor] = None,
                loss_mask: Optional[torch.Tensor] = None) -> ModelOutput:
        """tokens, labels `[b, s]` (replicated across TP); loss_mask `[b, s]` (1 = counts)."""
        x, aux_loss = run_layers(self.layers, self.embedding(tokens), partitioner=self.partitioner)  # [b, s, h]
        logits = self._logits(self.final_norm(x))  # [b, s, V_padded/tp]
        moe_stats = [moe.last_stats for moe in self.moe_layers()]
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
