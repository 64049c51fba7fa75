"""Pre-norm transformer layer (GPT-2, Radford et al. 2019 §2.3) whose FFN is dense or MoE.

    x = x + dropout(attention(norm_1(x)))
    x = x + dropout(ffn(norm_2(x)))        ffn = MoELayer iff moe_layer_flags(cfg)[layer_index]

Hidden states `[b, s, h]` are replicated across TP between sublayers (Megatron without sequence
parallelism); residual dropout therefore uses the TP-replicated generator.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from megatron_moe.config.schema import Config
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.attention import ATTENTIONS
from megatron_moe.model.mlp import MLP
from megatron_moe.model.norm import build_norm
from megatron_moe.tensor_parallel.param_meta import residual_output_std
from megatron_moe.model.recompute import recomputed
from megatron_moe.model.rotary import RotaryTables
from megatron_moe.config.errors import ConfigError
from megatron_moe.config.registry import Registry
from megatron_moe.config.validate import section_check
from megatron_moe.tensor_parallel import Dropout, DropoutRNG

# The MoE FFN: "moe" = moe/layer.py's MoELayer(cfg, state, layer_index), registered there, so that
# the model floor builds on no MoE code (docs/design.md, the floors).
FFN_LAYERS: Registry = Registry("moe.layer_freq")


def moe_layer_flags(cfg: Config) -> List[bool]:
    """Is layer i's FFN MoE, for the `model.num_layers` layers and then the `model.mtp_depth`
    multi-token prediction layers (model/mtp.py: depth k is layer num_layers + k - 1)?
    `moe.layer_pattern[i]` when given; else every `layer_freq`-th layer (1-based: freq 2 = layers
    1, 3, 5, ...) except the first `moe.first_k_dense` (DeepSeek's first_k_dense_replace). An MTP
    layer's FFN is the model's last layer's (Megatron-Core builds it from the decoder's last layer
    spec; DeepSeek-V3's is MoE; a dense model, layer_freq > num_layers, stays dense)."""
    m, moe = cfg.model, cfg.moe
    if moe.layer_pattern is not None:
        flags = [bool(x) for x in moe.layer_pattern]
    else:
        flags = [i >= moe.first_k_dense and (i + 1) % moe.layer_freq == 0 for i in range(m.num_layers)]
    return flags + flags[-1:] * m.mtp_depth


def moe_layer_spacing(cfg: Config) -> int:
    """Layers from one MoE FFN to the next, the fewest (the first counted from the model's start):
    `moe.layer_freq` for every-Nth patterns, num_layers + 1 without MoE layers. Pro-Prophet's
    non-MoE block and Lancet's default partition range per MoE layer."""
    moe = [i for i, flag in enumerate(moe_layer_flags(cfg)[: cfg.model.num_layers]) if flag]
    return min(b - a for a, b in zip([-1] + moe, moe)) if moe else cfg.model.num_layers + 1


@section_check("moe.layer_pattern")
def _check_layer_pattern(cfg: Config, world_size: int) -> None:
    """`moe.first_k_dense` and `moe.layer_pattern` (one 0 / 1 per layer, instead of layer_freq / first_k_dense)."""
    m, moe = cfg.model, cfg.moe
    if not 0 <= moe.first_k_dense <= m.num_layers:
        raise ConfigError(f"moe.first_k_dense={moe.first_k_dense} must be in [0, model.num_layers={m.num_layers}]")
    pattern = moe.layer_pattern
    if pattern is None:
        return
    if moe.layer_freq != 1 or moe.first_k_dense != 0:
        raise ConfigError(f"moe.layer_pattern replaces moe.layer_freq={moe.layer_freq} and moe.first_k_dense="
                          f"{moe.first_k_dense}: leave them at 1 and 0, or set moe.layer_pattern=null")
    if not isinstance(pattern, (list, tuple)) or not all(isinstance(x, int) and x in (0, 1) for x in pattern):
        raise ConfigError(f"moe.layer_pattern={pattern!r} must be a list of 0 (dense FFN) and 1 (MoE FFN), one per layer")
    if len(pattern) != m.num_layers:
        raise ConfigError(f"moe.layer_pattern has {len(pattern)} entries; model.num_layers={m.num_layers} needs "
                          "one per layer")


class TransformerLayer(torch.nn.Module):
    def __init__(self, cfg: Config, state: ParallelState, layer_index: int, rng: DropoutRNG, *,
                 causal: bool = True, rotary: Optional[RotaryTables] = None):
        super().__init__()
        m = cfg.model
        self.layer_index = layer_index
        output_std = residual_output_std(m)
        self.attention_norm = build_norm(m, state)
        self.attention = ATTENTIONS.get(m.attention)(m, state, rng, output_std=output_std, causal=causal,
                                       recompute=cfg.training.recompute == "selective", rotary=rotary,
                                       layer_index=layer_index)
        self.ffn_norm = build_norm(m, state)
        self.is_moe = moe_layer_flags(cfg)[layer_index]
        if self.is_moe:  # experts moe.expert_ffn_hidden_size wide, a dense FFN model.ffn_hidden_size
            self.ffn = FFN_LAYERS.get("moe")(cfg, state, layer_index)
        else:
            self.ffn = MLP(m, state, output_std=output_std)
        self.residual_dropout = Dropout(m.dropout, rng, "replicated")
        self.rng, self.recompute_layer = rng, cfg.training.recompute == "full"  # model/recompute.py

    def forward(self, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None, cache=None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """x `[b, s, h]` -> (`[b, s, h]`, the MoE layer's aux loss scalar or None for a dense FFN).
        `cache`: this layer's KV cache when decoding (megatron_moe/generation.py)."""
        if cache is not None:
            return self.ffn_sublayer(self.attention_sublayer(x, padding_mask, cache))
        if self.recompute_layer:  # training.recompute=full: keep x only, run again in backward
            return recomputed(self._forward, self.rng, x.device, x, padding_mask)
        return self._forward(x, padding_mask)

    def _forward(self, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        return self.ffn_sublayer(self.attention_sublayer(x, padding_mask))

    def attention_sublayer(self, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None,
                           cache=None) -> torch.Tensor:
        """x + dropout(attention(norm_1(x))) `[b, s, h]`."""
        return x + self.residual_dropout(self.attention(self.attention_norm(x), padding_mask, cache=cache))

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
