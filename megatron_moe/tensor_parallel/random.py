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

Lancet's partitioned forward (techniques/lancet/lancet_partition.py) runs batch parts of a micro-batch through
the same dropout sites, interleaved. Inside `batch_parts(...).part(q)` the i-th mask a part asks
for is row slice q of the i-th whole-micro-batch mask, drawn by whichever part asks first (the
first part leads at every site, so masks are drawn in the unpartitioned order): the masks are
those of the unpartitioned forward.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, List, Optional, Tuple

import torch

from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.tensor_parallel.param_meta import _seed_for

REGIONS = ("replicated", "sharded")


class DropoutRNG:
    def __init__(self, seed: int, state: ParallelState):
        c = state.layout.coords(state.rank)
        self.seeds = {
            "replicated": _seed_for(seed, f"dropout/replicated/pp{c['pp']}/dp{c['dp']}"),
            "sharded": _seed_for(seed, f"dropout/sharded/pp{c['pp']}/dp{c['dp']}/tp{c['tp']}"),
        }
        self._generators: Dict[Tuple[str, str], torch.Generator] = {}
        self._part: Optional[Tuple["BatchPartDraws", int]] = None  # (draws, part index) inside `part`

    def generator(self, region: str, device: torch.device) -> torch.Generator:
        key = (region, str(device))
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(self.seeds[region])
        return self._generators[key]

    def dropout(self, x: torch.Tensor, p: float, region: str) -> torch.Tensor:
        """Inverted dropout: zero each element with probability `p`, scale the rest by 1/(1-p)."""
        if self._part is not None:
            draws, index = self._part
            keep = draws.mask(index, x.shape, lambda shape: self._keep(shape, p, region, x.device), region)
        else:
            keep = self._keep(x.shape, p, region, x.device)
        return x * keep.to(x.dtype) / (1.0 - p)

    def _keep(self, shape, p: float, region: str, device: torch.device) -> torch.Tensor:
        return torch.rand(shape, generator=self.generator(region, device), device=device) >= p

    @property
    def in_batch_part(self) -> bool:
        """Inside `batch_parts(...).part(q)` (masks must then be drawn here, as slices of whole ones)."""
        return self._part is not None

    def batch_parts(self, sizes: List[int]) -> "BatchPartDraws":
        """Masks for one micro-batch run as batch parts of `sizes` rows (module docstring)."""
        return BatchPartDraws(self, sizes)

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {f"{region}@{device}": g.get_state() for (region, device), g in self._generators.items()}

    def load_state_dict(self, states: Dict[str, torch.Tensor]) -> None:
        for key, value in states.items():
            region, device = key.split("@")
            self.generator(region, torch.device(device)).set_state(value)


class BatchPartDraws:
    """The whole-micro-batch masks of one partitioned forward, handed out as batch-part slices."""

    def __init__(self, rng: DropoutRNG, sizes: List[int]):
        self.rng, self.sizes = rng, list(sizes)
        self.starts = [sum(sizes[:q]) for q in range(len(sizes))]
        self.masks: List[Tuple[str, torch.Tensor]] = []  # (region, Bool[B, ...]) in draw order
        self.calls = [0] * len(sizes)  # masks each part has taken

    def mask(self, index: int, shape, draw, region: str) -> torch.Tensor:
        """Part `index`'s slice of its next mask (drawn now by `draw(full shape)` if no part drew it yet)."""
        i = self.calls[index]
        self.calls[index] += 1
        if i == len(self.masks):
            self.masks.append((region, draw((sum(self.sizes),) + tuple(shape[1:]))))
        drawn_region, full = self.masks[i]
        if drawn_region != region or tuple(full.shape[1:]) != tuple(shape[1:]) or shape[0] != self.sizes[index]:
            raise RuntimeError(f"batch part {index}: dropout call {i} asks for {region} {tuple(shape)}, but the first "
                               f"part drew {drawn_region} {tuple(full.shape)}: the parts must run the same layers")
        return full.narrow(0, self.starts[index], self.sizes[index])

    @contextmanager
    def part(self, index: int):
        """Dropout inside this block draws part `index`'s masks (nests: restores the outer part)."""
        outer, self.rng._part = self.rng._part, (self, index)
        try:
            yield
        finally:
            self.rng._part = outer


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
