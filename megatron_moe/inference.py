"""`load_model(CKPT)`: a trained model on one process for notebooks and evaluation (issue 4 §6).

    from megatron_moe import load_model
    model = load_model("checkpoints/run1")          # a checkpoint root or one iter_* directory
    logits = model(tokens)                          # Long[b, s] -> Float[b, s, vocab_size]

Whatever layout the checkpoint was saved with, its global tensors are read into the
single-process model (tensor = expert = expert_shard = 1), or with `state` (a ParallelState of
tp / ep / esp ranks under torchrun; collective) into that layout's shards. Only weights are read;
the model is in eval mode (no dropout). `overrides`: dotted config keys applied to the saved config
(`DROPLESS` for generation, megatron_moe/generation.py).
"""
from __future__ import annotations

import torch

from megatron_moe.config.validate import validate_config
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.training.checkpoint import (NO_PIPELINE, checkpoint_config, load_checkpoint, model_entries,
                                              resolve_checkpoint)
from megatron_moe.training.checkpoint_io import load_entries

# generation routes every token (a one-token step's expert capacity would drop most of them)
DROPLESS = ("moe.capacity_factor=null",)


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


def layout_overrides(state: ParallelState) -> list:
    """The config keys that make a checkpoint's config describe `state`'s layout, without pipeline stages."""
    return [f"parallel.tensor={state.tp_size}", f"parallel.expert={state.ep_size}",
            f"parallel.expert_shard={state.esp_size}", "checkpoint.load=null"] + NO_PIPELINE


def launch_layout(tensor: int = 1, expert: int = 1):
    """torch.distributed started for the launcher's processes (not for one) -> (LaunchInfo, the tp / ep
    ParallelState over them): the layout `load_model(state=)` loads into (tools/generate.py, the lm-eval backend)."""
    from megatron_moe.distributed import launch
    from megatron_moe.distributed.parallel_state import RankLayout

    info = launch.initialize("auto")
    return info, ParallelState.build(RankLayout(world_size=info.world_size, tensor=tensor, expert=expert), info.rank)


@torch.no_grad()
def load_model(path: str, device: str = "cpu", overrides=(), state: ParallelState = None) -> CausalLM:
    """The model of checkpoint `path` (root -> its newest complete checkpoint), verified, in eval mode
    (module docstring). Collective when `state` has several ranks."""
    path = resolve_checkpoint(path)
    state = state or ParallelState.single_process()
    if state.pp_size > 1:
        raise ValueError(f"load_model loads into tensor / expert parallel layouts; got pipeline={state.pp_size}")
    cfg = checkpoint_config(path, layout_overrides(state) + list(overrides))
    if state.world_size == 1:
        model = build_single_process_model(cfg)
        load_entries(model_entries(model, state), path, single_process=True)
        return CausalLM(model).to(device).eval()
    from megatron_moe.model.gpt import GPTMoEModel

    validate_config(cfg, state.world_size)
    model = GPTMoEModel(cfg, state).to(device)
    load_checkpoint(path, cfg, state, model, None)
    return CausalLM(model).eval()
