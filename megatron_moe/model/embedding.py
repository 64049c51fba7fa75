"""Input embedding: vocab-parallel word embedding + learned absolute positions (GPT-2) [+ token
types (BERT segments A/B)], then dropout.

tokens `[b, s]` (replicated across TP) -> hidden `[b, s, h]` (replicated across TP). With rotary
positions (`model.position_embedding: rope`) there is no position table; attention rotates q/k.
`word_only`: just the word table (a last pipeline stage's copy for the tied output layer,
model/pipeline_stages.py); it is not called.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_moe.config.schema import ModelConfig
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.tensor_parallel.param_meta import ParamMeta, make_param
from megatron_moe.tensor_parallel import Dropout, DropoutRNG, VocabParallelEmbedding


class Embedding(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, state: ParallelState, rng: DropoutRNG, num_token_types: int = 0,
                 word_only: bool = False):
        super().__init__()
        self.word = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, state, std=cfg.init_std)
        self.position = None
        if cfg.position_embedding == "learned" and not word_only:
            self.position = make_param(ParamMeta("dense", (cfg.seq_length, cfg.hidden_size), std=cfg.init_std,
                                                       role="embedding"), state)
        self.token_type = None
        if num_token_types:
            self.token_type = make_param(ParamMeta("dense", (num_token_types, cfg.hidden_size), std=cfg.init_std,
                                                   role="embedding"), state)
        self.dropout = Dropout(cfg.dropout, rng, "replicated")

    def forward(self, tokens: torch.Tensor, token_types: Optional[torch.Tensor] = None,
                positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`positions` `[b, s]`: each token's position (decoding with a KV cache, megatron_moe/generation.py);
        None = 0 .. s-1."""
        x = self.word(tokens)  # [b, s, h]
        if self.position is not None:
            if tokens.shape[1] > self.position.shape[0]:
                raise ValueError(f"sequence length {tokens.shape[1]} exceeds model.seq_length={self.position.shape[0]}")
            x = x + (self.position[: tokens.shape[1]] if positions is None else self.position[positions])
        if self.token_type is not None:
            x = x + self.token_type[token_types]  # [b, s, h]
        return self.dropout(x)
