"""Activation recomputation (`training.recompute`; Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", §4, Megatron-LM's --recompute-granularity).

* ``selective``: each attention's core (QK^T, softmax, dropout, x V) keeps only its inputs q, k, v
  and runs again in backward (the paper's selective recomputation: the [b, heads, s, s] tensors).
* ``full``: each transformer layer keeps only its input and runs again in backward; MoE layers
  included (their all-to-alls run again, in backward, in the same order on every rank).

Both are exact: the recomputed forward is the original one.
* Dropout: `recomputed` saves the model's `DropoutRNG` generator states before the first run and
  replays them in the recomputation (then puts the current states back), so the masks are equal.
* MoE: inside a recomputation (`is_recomputing()`), an MoE layer reuses the placements its
  balancer planned in the original forward (a balancer's state may have moved since: Pro-Prophet
  re-plans in `observe`), and does not teach the balancer, prefetch, or overwrite its statistics.
  Its replicas come by one Trans even where the original forward's was prefetched in two parts:
  the same weights, and neither path keeps tensors for backward that the other does not.
* torch.utils.checkpoint's early stop is off: a recomputation always runs to the end, so no
  collective of it is left half-issued.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from megatron_moe.tensor_parallel.random import REGIONS

_state = threading.local()


def is_recomputing() -> bool:
    """True while a forward runs again inside backward."""
    return getattr(_state, "depth", 0) > 0


@contextmanager
def _recomputing():
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def recomputed(fn: Callable, rng, device: torch.device, *args):
    """fn(*args), keeping only its inputs for backward and running it again there, with the
    dropout generators of `rng` (a DropoutRNG) on `device` replayed. Without autograd: fn(*args)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    for region in REGIONS:
        rng.generator(region, device)  # exist now, so their states before fn are saved
    before = rng.state_dict()
    runs = [0]

    def run(*inputs):
        runs[0] += 1
        if runs[0] == 1:
            return fn(*inputs)
        now = rng.state_dict()
        rng.load_state_dict(before)
        try:
            with _recomputing():
                return fn(*inputs)
        finally:
            rng.load_state_dict(now)

    with set_checkpoint_early_stop(False):
        return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=False)
