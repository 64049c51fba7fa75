"""Dropout random numbers under tensor parallelism (Megatron-LM §3, last paragraph).

Two regions need different randomness:

* ``"replicated"``: tensors that every TP rank holds in full (embedding output, residual stream).
  All TP ranks must drop the same elements, or the replicas diverge. Seeded from
  (seed, pipeline rank, data-parallel rank): identical across TP, different across data-parallel
  replicas (they see different tokens anyway).
* ``"sharded"``: tensors split across TP (attention probabilities of this rank's heads). Each rank
  draws its own mask. Seeded from (seed, pipeline rank, data-parallel rank, tensor rank).

Each region owns one `torch.Generator` per device; masks are drawn explicitly with `torch.rand`,
so the global torch RNG is never touched and the scheme is the same on CPU and GPU. With
dropout 0 nothing is drawn. The generator states are exposed for checkpoints (`state_dict`).
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.param_meta import _seed_for

REGIONS = ("replicated", "sharded")


class DropoutRNG:
    def __init__(self, seed: int, state: ParallelState):
        c = state.layout.coords(state.rank)
        self.seeds = {
            "replicated": _seed_for(seed, f"dropout/replicated/pp{c['pp']}/dp{c['dp']}"),
            "sharded": _seed_for(seed, f"dropout/sharded/pp{c['pp']}/dp{c['dp']}/tp{c['tp']}"),
        }
        self._generators: Dict[Tuple[str, str], torch.Generator] = {}

    def generator(self, region: str, device: torch.device) -> torch.Generator:
        key = (region, str(device))
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(self.seeds[region])
        return self._generators[key]

    def dropout(self, x: torch.Tensor, p: float, region: str) -> torch.Tensor:
        """Inverted dropout: zero each element with probability `p`, scale the rest by 1/(1-p)."""
        keep = torch.rand(x.shape, generator=self.generator(region, x.device), device=x.device) >= p
        return x * keep.to(x.dtype) / (1.0 - p)

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {f"{region}@{device}": g.get_state() for (region, device), g in self._generators.items()}

    def load_state_dict(self, states: Dict[str, torch.Tensor]) -> None:
        for key, value in states.items():
            region, device = key.split("@")
            self.generator(region, torch.device(device)).set_state(value)


class Dropout(torch.nn.Module):
    """`torch.nn.Dropout` drawing its mask from a `DropoutRNG` region (active in training mode only)."""

    def __init__(self, p: float, rng: DropoutRNG, region: str):
        super().__init__()
        assert region in REGIONS, region
        self.p, self.rng, self.region = p, rng, region

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        return self.rng.dropout(x, self.p, self.region)
