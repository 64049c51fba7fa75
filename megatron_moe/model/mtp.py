"""Multi-token prediction (MTP; DeepSeek-V3 §2.2, Eqs. 21-25; `model.mtp_depth` D, `training.mtp_loss_weight` λ).

Depth k = 1..D predicts token t_{i+k+1} at position i from the previous depth's representation
h_{k-1} (h_0: the main model's output after its final norm, the tensor its output head sees, as in
Megatron-Core) and the embedding of token t_{i+k}:

    h'_k = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h_{k-1})]      Eq. 21, M_k = eh_proj [h, 2h]
    h_k  = final_norm(TRM_k(h'_k))                            Eq. 22, passed on to depth k + 1
    P_k  = OutHead(h_k)                                       Eq. 23
    L_k  = CE(P_k, t_{i+k+1}) over the positions that have a label     Eq. 24
    L_MTP = λ / D · Σ_k L_k                                   Eq. 25, added to the LM loss

Concatenation order: [enorm(embedding); hnorm(hidden)], as the released DeepSeek-V3 checkpoint
(layer 61), Megatron-Core's multi_token_prediction.py and vLLM's deepseek_mtp.py; the paper prints
[h; emb], which is the same model with the columns of M_k swapped. Emb is the shared word table
(no position table: DeepSeek-V3 has none; with learned positions h_{k-1} carries them), OutHead the
model's shared output layer (or the tied embedding). TRM_k is one `TransformerLayer` with layer index
num_layers + k - 1: its FFN is MoE as the model's last layer's (`moe_layer_flags`), and an MoE FFN
is a MoE layer like any other (balancers, schedules, statistics, routing traces, checkpoints).

Parameters: `mtp.<k-1>.enorm.weight`, `.hnorm.weight`, `.eh_proj.weight` [h, 2h] (column-parallel
over TP, output gathered), `.layer.<the names of layers.<i>.*>`, `.final_norm.weight`.

Shifts: depth k's inputs are the tokens rolled left by k, its labels the labels rolled left by k
and its loss mask the loss mask rolled left by k with the last k positions zeroed (no label there;
those positions get token 0, as Megatron-Core's roll_tensor; attention is causal, so they never
reach a position with a label). L_k is the mean over its unmasked positions, as the LM loss.

MTP is a training objective: it runs on the last pipeline stage in training forwards with labels;
evaluation and inference (`model.eval()`, no labels) skip it (the validation loss is the LM loss).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import math

import torch

from megatron_moe.config.errors import ConfigError
from megatron_moe.config.schema import Config
from megatron_moe.config.validate import section_check
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.norm import build_norm
from megatron_moe.model.rotary import RotaryTables
from megatron_moe.model.transformer import TransformerLayer
from megatron_moe.tensor_parallel import ColumnParallelLinear, DropoutRNG


class MTPDepth(torch.nn.Module):
    """MTP module k (1-based `depth`): (h_{k-1}, Emb(t_{i+k})) `[b, s, h]` each -> h_k `[b, s, h]`."""

    def __init__(self, cfg: Config, state: ParallelState, depth: int, rng: DropoutRNG,
                 rotary: Optional[RotaryTables]):
        super().__init__()
        m = cfg.model
        self.enorm, self.hnorm = build_norm(m, state), build_norm(m, state)
        self.eh_proj = ColumnParallelLinear(2 * m.hidden_size, m.hidden_size, state, bias=False, std=m.init_std,
                                            gather_output=True)
        self.layer = TransformerLayer(cfg, state, m.num_layers + depth - 1, rng, causal=True, rotary=rotary)
        self.final_norm = build_norm(m, state)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """-> (h_k `[b, s, h]`, the MoE layer's aux loss or None)."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))  # [b, s, 2h] -> [b, s, h]
        x, aux_loss = self.layer(x)
        return self.final_norm(x), aux_loss


def build_mtp(cfg: Config, state: ParallelState, rng: DropoutRNG,
              rotary: Optional[RotaryTables]) -> Optional[torch.nn.ModuleList]:
    """The D depths (`mtp.<k-1>.*`), or None when `model.mtp_depth` is 0."""
    depth = cfg.model.mtp_depth
    return torch.nn.ModuleList([MTPDepth(cfg, state, k, rng, rotary) for k in range(1, depth + 1)]) if depth else None


def shifted(t: torch.Tensor, k: int) -> torch.Tensor:
    """`[b, s]` rolled left by k along the sequence, the last k positions 0."""
    out = torch.roll(t, -k, dims=1)
    out[:, t.shape[1] - k:] = 0
    return out


def mtp_forward(depths, hidden: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor,
                loss_mask: Optional[torch.Tensor], embed: Callable, token_losses: Callable):
    """hidden `[b, s, h]` (h_0), tokens / labels / loss_mask `[b, s]`; `embed(tokens)` -> `[b, s, h]`,
    `token_losses(h, labels)` -> per-token CE `[b, s]` through the shared head. Returns (1/D Σ_k L_k:
    Eq. 25 without λ, the MTP layers' aux loss sum or None, their MoE stats)."""
    mask = torch.ones_like(tokens, dtype=torch.float32) if loss_mask is None else loss_mask.float()
    losses, aux_losses, stats = [], [], []
    for k, depth in enumerate(depths, start=1):
        hidden, aux_loss = depth(hidden, embed(shifted(tokens, k)))  # t_{i+k}
        mask_k = shifted(mask, k)  # the label t_{i+k+1} of position i is labels[i + k]
        ce = token_losses(hidden, shifted(labels, k))  # [b, s]
        losses.append((ce * mask_k).sum() / mask_k.sum().clamp(min=1.0))
        if aux_loss is not None:
            aux_losses.append(aux_loss)
            stats.append(depth.layer.ffn.last_stats)
    aux = torch.stack(aux_losses).sum() if aux_losses else None
    return torch.stack(losses).mean(), aux, stats


def mtp_layers(depths) -> List[torch.nn.Module]:
    """The depths' transformer layers, in order ([] without MTP)."""
    return [depth.layer for depth in depths] if depths is not None else []


@section_check("model.mtp_depth")
def _check_mtp(cfg: Config, world_size: int) -> None:
    """`model.mtp_depth` and `training.mtp_loss_weight`."""
    m, weight = cfg.model, cfg.training.mtp_loss_weight
    if not 0 <= m.mtp_depth < m.seq_length:
        raise ConfigError(f"model.mtp_depth={m.mtp_depth} must be in [0, model.seq_length={m.seq_length}) "
                          "(depth k needs positions with a token k + 1 ahead)")
    if m.mtp_depth and m.layer_types is not None:  # per model layer: the MTP layers (index >= num_layers) have none
        raise ConfigError(f"model.mtp_depth={m.mtp_depth} with model.layer_types: the MTP layers have no entry; "
                          "set model.layer_types=null or model.mtp_depth=0")
    if not (math.isfinite(weight) and weight >= 0):
        raise ConfigError(f"training.mtp_loss_weight={weight} must be a finite number >= 0")
