"""Shared experts (`moe.shared_expert_ffn_hidden_size`; DeepSeekMoE, Dai et al. 2024, §3.2; Qwen2-MoE).

A dense FFN of width f_s that every token passes through, next to the routed experts:

    y = routed(x) + g(x) * FFN_s(x),   g(x) = sigmoid(x w_g^T), w_g [1, h]   (`moe.shared_expert_gate`; else g = 1)

FFN_s is the dense MLP (model/mlp.py, `model.activation`, `model.bias`) split across TP like the
dense layers: column-parallel fc1, row-parallel fc2, one all-reduce. Several shared experts of
width f are one of width (number x f) (DeepSeek-V3: one). w_g is replicated across TP. The
MoE layer runs it while the routed tokens' dispatch all-to-all is in flight (`RunHooks`; Megatron's
`moe_shared_expert_overlap`), or at once when the schedule has no all-to-all to hide it behind.
"""
from __future__ import annotations

import dataclasses

import torch

from megatron_moe.config.errors import ConfigError
from megatron_moe.config.schema import Config
from megatron_moe.config.validate import section_check
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.mlp import MLP
from megatron_moe.tensor_parallel.param_meta import ParamMeta, make_param
from megatron_moe.model.transformer import residual_output_std


class SharedExpert(torch.nn.Module):
    """x `[n, h]` replicated across TP -> `[n, h]` replicated."""

    def __init__(self, cfg: Config, state: ParallelState):
        super().__init__()
        m = cfg.model
        width = dataclasses.replace(m, ffn_hidden_size=cfg.moe.shared_expert_ffn_hidden_size)
        self.mlp = MLP(width, state, output_std=residual_output_std(m))
        self.gate = None
        if cfg.moe.shared_expert_gate:
            self.gate = make_param(ParamMeta("dense", (1, m.hidden_size), std=m.init_std, role="weight"), state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mlp(x)
        if self.gate is None:
            return y
        # computed whole on every TP rank (x and w_g are replicated): its gradients are whole too
        gate = torch.sigmoid(torch.nn.functional.linear(x, self.gate))  # [n, 1]
        return gate * y


@section_check("moe.shared_expert")
def check_shared_expert_config(cfg: Config, world_size: int) -> None:
    f = cfg.moe.shared_expert_ffn_hidden_size
    if f is None:
        if cfg.moe.shared_expert_gate:
            raise ConfigError("moe.shared_expert_gate=true needs moe.shared_expert_ffn_hidden_size")
        return
    if f < 1 or f % cfg.parallel.tensor:
        raise ConfigError(f"moe.shared_expert_ffn_hidden_size={f} must be >= 1 and divisible by "
                          f"parallel.tensor={cfg.parallel.tensor}")
