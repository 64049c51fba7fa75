"""Pre-norm transformer layer (GPT-2, Radford et al. 2019 §2.3) whose FFN is dense or MoE.

    x = x + dropout(attention(norm_1(x)))
    x = x + dropout(ffn(norm_2(x)))        ffn = MoELayer iff (layer_index + 1) % moe.layer_freq == 0

Hidden states `[b, s, h]` are replicated across TP between sublayers (Megatron without sequence
parallelism); residual dropout therefore uses the TP-replicated generator.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from megatron_moe.config.schema import Config
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.attention import SelfAttention
from megatron_moe.model.mlp import MLP
from megatron_moe.model.norm import build_norm
from megatron_moe.tensor_parallel.param_meta import residual_output_std
from megatron_moe.model.recompute import recomputed
from megatron_moe.model.rotary import RotaryTables
from megatron_moe.config.registry import Registry
from megatron_moe.tensor_parallel import Dropout, DropoutRNG

# The MoE FFN: "moe" = moe/layer.py's MoELayer(cfg, state, layer_index), registered there, so that
# the model floor builds on no MoE code (docs/design.md, the floors).
FFN_LAYERS: Registry = Registry("moe.layer_freq")


def is_moe_layer(layer_index: int, layer_freq: int) -> bool:
    """Every `layer_freq`-th layer (1-based) has an MoE FFN: freq 1 = all, 2 = layers 1, 3, 5, ..."""
    return (layer_index + 1) % layer_freq == 0


class TransformerLayer(torch.nn.Module):
    def __init__(self, cfg: Config, state: ParallelState, layer_index: int, rng: DropoutRNG, *,
                 causal: bool = True, rotary: Optional[RotaryTables] = None):
        super().__init__()
        m = cfg.model
        self.layer_index = layer_index
        output_std = residual_output_std(m)
        self.attention_norm = build_norm(m, state)
        self.attention = SelfAttention(m, state, rng, output_std=output_std, causal=causal,
                                       recompute=cfg.training.recompute == "selective", rotary=rotary)
        self.ffn_norm = build_norm(m, state)
        self.is_moe = is_moe_layer(layer_index, cfg.moe.layer_freq)
        if self.is_moe:

            self.ffn = FFN_LAYERS.get("moe")(cfg, state, layer_index)
        else:
            self.ffn = MLP(m, state, output_std=output_std)
        self.residual_dropout = Dropout(m.dropout, rng, "replicated")
        self.rng, self.recompute_layer = rng, cfg.training.recompute == "full"  # model/recompute.py

    def forward(self, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """x `[b, s, h]` -> (`[b, s, h]`, the MoE layer's aux loss scalar or None for a dense FFN)."""
        if self.recompute_layer:  # training.recompute=full: keep x only, run again in backward
            return recomputed(self._forward, self.rng, x.device, x, padding_mask)
        return self._forward(x, padding_mask)

    def _forward(self, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        return self.ffn_sublayer(self.attention_sublayer(x, padding_mask))

    def attention_sublayer(self, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x + dropout(attention(norm_1(x))) `[b, s, h]`."""
        return x + self.residual_dropout(self.attention(self.attention_norm(x), padding_mask))

    def ffn_sublayer(self, x: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(x + dropout(ffn(norm_2(x))) `[b, s, h]`, the MoE layer's aux loss or None)."""
        h = self.ffn_norm(x)
        aux_loss = None
        if self.is_moe:
            y, aux_loss = self.ffn(h)
        else:
            y = self.ffn(h)
        return x + self.residual_dropout(y), aux_loss


def run_layers(layers, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None, partitioner=None
               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """x `[b, s, h]` through every layer -> (`[b, s, h]`, sum of the MoE layers' aux losses, a 0
    tensor when there are none). `partitioner`: Lancet's partitioned forward
    (techniques/lancet/lancet_partition.py, `moe.lancet.partitions`), which runs the layers instead."""
    link_moe_layers(moe_ffns(layers))
    if partitioner is not None:
        return partitioner.run(layers, x, padding_mask)
    aux_losses = []
    for layer in layers:
        x, aux_loss = layer(x, padding_mask)
        if aux_loss is not None:
            aux_losses.append(aux_loss)
    aux_loss = torch.stack(aux_losses).sum() if aux_losses else torch.zeros((), device=x.device)
    return x, aux_loss


def link_moe_layers(moe_layers) -> None:
    """Tell each MoE layer which MoE layer follows it in the forward pass (idempotent; cross-layer
    scheduling, techniques/proprophet/cross_layer.py, reads `next_moe`)."""
    for layer, successor in zip(moe_layers, list(moe_layers[1:]) + [None]):
        object.__setattr__(layer, "next_moe", successor)  # a plain reference, not a submodule


def moe_ffns(layers) -> List[torch.nn.Module]:
    """The MoE layers among `layers`' FFNs, in order."""
    return [layer.ffn for layer in layers if layer.is_moe]
