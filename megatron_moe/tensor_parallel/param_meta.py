"""Global identity of every parameter: its full shape, how it is sharded, where it is replicated.

Each `nn.Parameter` of a model carries `param.meta: ParamMeta`. One description serves:

* layout-independent initialization (`init_from_seed_`): the full tensor is drawn from the seed and
  the parameter name, then this rank keeps its shard, so 1 process and 8 get the same model;
* gradient sync: `kind == "dense"` is averaged over `dp`, `kind == "expert"` over `edp`;
* global grad-norm: a parameter's squared norm is summed over the groups it is sharded over and
  counted once where it is replicated (norms and router weights are not counted tp times);
* checkpoints: global shape + this rank's offsets (torch.distributed.checkpoint);
* weight decay (`training/optimizer.py`): `role` says what the parameter is.

Roles (`ROLES`): "weight" = a matrix applied to activations (linear weights, the router weight, the
experts' stacked w1/w2); "embedding" = a lookup table (word, position and token-type embeddings);
"bias" = an additive bias, also the experts' stacked b1 [E, W] / b2 [E, h], whatever its rank;
"norm" = a LayerNorm/RMSNorm scale or shift. The optimizer decays "weight" and "embedding".

Sharding is a list of (dim, group name): e.g. a column-parallel weight [out, in] is
``[(0, "tp")]``; the experts' first weight [E, hidden, ffn] is ``[(0, "ep"), (2, "esp")]``.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from megatron_moe.config.schema import ModelConfig
from megatron_moe.distributed.parallel_state import ParallelState


ROLES = ("weight", "embedding", "bias", "norm")


@dataclass
class ParamMeta:
    kind: str  # "dense" | "expert"
    global_shape: Tuple[int, ...]
    shards: List[Tuple[int, str]] = field(default_factory=list)  # (dim, group name), group sizes divide dims
    init: str = "normal"  # normal | zeros | ones
    std: float = 0.02
    # rows beyond this index along dim 0 are padding (zeros; e.g. padded vocabulary), or None
    valid_rows: Optional[int] = None
    role: str = "weight"  # one of ROLES: what the parameter is (decides weight decay)

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"ParamMeta.role={self.role!r} must be one of {', '.join(ROLES)}")

    def sharded_groups(self) -> List[str]:
        return [g for _, g in self.shards]

    def local_shape(self, state: ParallelState) -> Tuple[int, ...]:
        shape = list(self.global_shape)
        for dim, group in self.shards:
            size = state.groups[group].size
            assert shape[dim] % size == 0, (self, group)
            shape[dim] //= size
        return tuple(shape)

    def offsets(self, state: ParallelState) -> Tuple[int, ...]:
        """This rank's offset into the global tensor along every dim."""
        off = [0] * len(self.global_shape)
        for dim, group in self.shards:
            g = state.groups[group]
            off[dim] = g.rank * (self.global_shape[dim] // g.size)
        return tuple(off)

    def local_slices(self, state: ParallelState) -> Tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offsets(state), self.local_shape(state)))


def residual_output_std(cfg: ModelConfig) -> float:
    """Init std of projections that write into the residual stream: GPT-2 §2.3 scales them by
    1/sqrt(number of residual layers) = 1/sqrt(2 * num_layers) (Megatron's scaled_init_method)."""
    return cfg.init_std / math.sqrt(2.0 * cfg.num_layers)


def make_param(meta: ParamMeta, state: ParallelState) -> torch.nn.Parameter:
    """An uninitialized local shard with `meta` attached (call `init_from_seed_` afterwards)."""
    p = torch.nn.Parameter(torch.empty(meta.local_shape(state)))
    p.meta = meta
    return p


def _seed_for(seed: int, name: str, index: int = -1) -> int:
    digest = hashlib.sha256(f"{seed}/{name}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_from_seed_(param: torch.nn.Parameter, name: str, seed: int, state: ParallelState) -> None:
    """Fill `param` (a local shard) with its slice of the full tensor drawn from (seed, name).

    Expert parameters draw each expert (dim 0) from its own generator, so a rank only materializes
    the experts it holds (`param.expert_rows()`: (local row, expert) pairs of vExpert slots, else
    its owned range); everything else draws the full tensor once and slices it.
    """
    meta: ParamMeta = param.meta
    if meta.init == "zeros":
        param.zero_()
        return
    if meta.init == "ones":
        param.fill_(1.0)
        return
    slices = meta.local_slices(state)
    rows = meta.valid_rows if meta.valid_rows is not None else meta.global_shape[0]
    if meta.kind == "expert":
        rows = param.expert_rows() if hasattr(param, "expert_rows") else \
            enumerate(range(slices[0].start, slices[0].stop))  # vExpert slots (moe/vexperts.py) or owned
        for local_i, global_i in rows:
            gen = torch.Generator().manual_seed(_seed_for(seed, name, global_i))
            full = torch.randn(meta.global_shape[1:], generator=gen) * meta.std
            param[local_i].copy_(full[slices[1:]])
        return
    gen = torch.Generator().manual_seed(_seed_for(seed, name))
    full = torch.zeros(meta.global_shape)
    full[:rows] = torch.randn((rows,) + tuple(meta.global_shape[1:]), generator=gen) * meta.std
    param.copy_(full[slices])


def init_model_from_seed_(model: torch.nn.Module, seed: int, state: ParallelState) -> None:
    """Initialize every parameter that has a `meta` from the seed; names are the module's
    `named_parameters()` names, so they are identical on every layout. A model built on the meta
    device (the cluster simulator's parameter inventory, sim/params.py) has no values to fill."""
    for name, p in model.named_parameters():
        if hasattr(p, "meta") and not p.is_meta:
            init_from_seed_(p, name, seed, state)
