"""`load_model(CKPT)`: a trained model on one process for notebooks and evaluation (issue 4 §6).

    from megatron_moe import load_model
    model = load_model("checkpoints/run1")          # a checkpoint root or one iter_* directory
    logits = model(tokens)                          # Long[b, s] -> Float[b, s, vocab_size]

Whatever layout the checkpoint was saved with, its global tensors are read into the
single-process model (tensor = expert = expert_shard = 1). Only weights are read; the model is in
eval mode (no dropout).
"""
from __future__ import annotations

import torch

from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.training.checkpoint import model_entries, resolve_checkpoint, single_process_config
from megatron_moe.training.checkpoint_io import load_entries


class CausalLM(torch.nn.Module):
    """Wraps a GPT-MoE model: `forward(tokens [b, s]) -> logits [b, s, vocab_size]`."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.cfg = model.cfg

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.gather_logits(self.model(tokens).logits)


def build_single_process_model(cfg) -> torch.nn.Module:
    from megatron_moe.model.gpt import GPTMoEModel

    return GPTMoEModel(cfg, ParallelState.single_process())


@torch.no_grad()
def load_model(path: str, device: str = "cpu") -> CausalLM:
    """The model of checkpoint `path` (root -> its newest complete checkpoint), verified, in eval mode."""
    path = resolve_checkpoint(path)
    model = build_single_process_model(single_process_config(path))
    load_entries(model_entries(model, ParallelState.single_process()), path, single_process=True)
    return CausalLM(model).to(device).eval()
