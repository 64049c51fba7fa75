"""Gradient synchronization across replicas and global grad-norm clipping (DESIGN.md §3, §5).

Each rank back-propagates (lm_loss + aux_loss) / num_local_micro_batches, so the gradient of the
global-batch mean loss is the SUM over data-parallel ranks divided by dp_size:

* dense params (kind "dense") are replicated over ``dp``: all-reduce SUM over ``dp``, / dp_size;
* expert params (kind "expert") are replicated over ``edp``; an expert copy already saw the tokens
  of every data-parallel rank of its ``ep_esp`` group, so: SUM over ``edp``, / dp_size (not edp_size);
* a param replicated across a group that splits its layer's compute (dense params not sharded over
  ``tp``, expert params not sharded over ``esp``: norms, biases, router, ...) gets the same gradient
  on every member of that group; it is also averaged over it so the copies stay bit-identical.

* the tied word embedding under pipeline parallelism (`tied_across_stages`, model/pipeline_stages.py)
  has a copy on the first and on the last stage, each holding part of its gradient: SUM over the
  ``embedding`` group as well (Megatron's embedding all-reduce), after the other buckets.

In bf16 runs every gradient here is the parameter's fp32 `main_grad` (model/precision.py,
`grad_of`): sums, norms and clipping run in fp32, as Megatron-LM's with its fp32 grad buffers.

Gradients are flattened into buckets (same groups, scale, dtype, device; at most `bucket_bytes`)
so there is one all-reduce per bucket and group, not one per parameter. With the distributed
optimizer (`replicas=False`) the replica sum over dp / edp and the 1/dp_size are left to its
reduce-scatter (training/distributed_optimizer.py); the rest happens here.

Global grad norm: each parameter counted exactly once. A param's squared norm is summed over the
groups in ``p.meta.shards`` (its shards are disjoint pieces); replicated copies (over dp, edp, tp,
esp) are identical after `sync` and are not summed -- the classic MoE bug counts expert or
tp-replicated params once per copy. vExpert copies of the same expert on several EP ranks
(FlexMoE, EPLB) count once too (`_squared_norm`), and so does the tied word embedding (the last stage's copy is
`pipeline_duplicate`). Each pipeline stage holds its own parameters: the stages' sums are added
over ``pp`` (`reduce_squared_norms`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch

from megatron_moe.distributed import collectives
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.precision import grad_dtype, grad_of, has_main_grad

BUCKET_BYTES = 32 << 20

# the group whose ranks split a layer's compute, per param kind; a param not sharded over it is
# replicated there and averaged over it
COMPUTE_GROUP = {"dense": "tp", "expert": "esp"}
REPLICA_GROUP = {"dense": "dp", "expert": "edp"}


def _squared_norm(p: torch.nn.Parameter) -> torch.Tensor:
    """Squared norm of this rank's gradient of `p`; of a vExpert stack (moe/vexperts.py) only the
    rows whose expert no lower EP rank holds count (the other holders have the same gradient)."""
    grad = grad_of(p)
    squared = grad.float().pow(2)
    slots = getattr(p, "vexpert_slots", None)
    if slots is None:
        return squared.sum()
    return squared.flatten(1).sum(1)[slots.canonical_rows(slots.ep_rank).to(grad.device)].sum()


def counts_in_norm(p: torch.nn.Parameter) -> bool:
    """False for the last stage's copy of a tied embedding (the first stage's copy counts)."""
    return not getattr(p, "pipeline_duplicate", False)


def norm_reductions(keys: Sequence[Tuple[str, ...]]) -> List[Tuple[str, List[int]]]:
    """The all-reduces `reduce_squared_norms` runs before its ``pp`` sum, in order: (group, the rows
    of the sorted keys it sums), one fp32 element per row."""
    keys = sorted(keys)
    return [(name, [i for i, k in enumerate(keys) if name in k]) for name in sorted({g for k in keys for g in k})]


def reduce_squared_norms(squared: Dict[Tuple[str, ...], torch.Tensor], state: ParallelState,
                         device: torch.device) -> float:
    """sqrt of the global sum of squares: `squared[key]` is this rank's sum over parameter pieces
    that are disjoint across the groups `key` (summed over each of them), replicated elsewhere; the
    pipeline stages' totals are summed over ``pp``. Same on every rank."""
    keys = sorted(squared)
    if not keys:
        total = torch.zeros((), device=device)
    else:
        sq = torch.stack([squared[k] for k in keys])  # [num keys]
        for name, rows in norm_reductions(keys):
            part = sq[rows].clone()
            collectives.all_reduce(part, state.groups[name])
            sq[rows] = part
        total = sq.sum()
    return float(collectives.all_reduce(total.reshape(1), state.pp)[0].sqrt())


@dataclass
class _Bucket:
    params: List[torch.nn.Parameter]
    groups: Tuple[str, ...]  # all-reduce SUM over each, in order
    scale: float  # then multiply by this
    nbytes: int = 0


def _sync_plan(p: torch.nn.Parameter, state: ParallelState, replicas: bool) -> Tuple[Tuple[str, ...], float]:
    meta = p.meta
    groups, scale = ([REPLICA_GROUP[meta.kind]], 1.0 / state.dp_size) if replicas else ([], 1.0)
    compute = COMPUTE_GROUP[meta.kind]
    if compute not in meta.sharded_groups():
        groups.append(compute)
        scale /= state.groups[compute].size
    if getattr(p, "tied_across_stages", False):
        groups.append("embedding")
    return tuple(g for g in groups if state.groups[g].size > 1), scale


class GradSync:
    """Bucketed gradient all-reduce + grad-norm clipping for one model on one ParallelState."""

    def __init__(self, named_params: Sequence[Tuple[str, torch.nn.Parameter]], state: ParallelState,
                 bucket_bytes: int = BUCKET_BYTES, replicas: bool = True):
        self.state = state
        self.params = []
        for name, p in named_params:
            assert hasattr(p, "meta"), f"parameter {name} has no ParamMeta (use make_param)"
            if p.requires_grad:
                self.params.append(p)
        open_buckets: Dict[tuple, _Bucket] = {}
        self.buckets: List[_Bucket] = []
        for p in self.params:
            groups, scale = _sync_plan(p, state, replicas)
            if not groups and scale == 1.0:
                continue
            dtype = grad_dtype(p)  # fp32 main gradients of bf16 parameters
            key = (groups, scale, dtype, p.device)
            nbytes = p.numel() * dtype.itemsize
            bucket = open_buckets.get(key)
            if bucket is None or bucket.nbytes + nbytes > bucket_bytes:
                bucket = open_buckets[key] = _Bucket([], groups, scale)
                self.buckets.append(bucket)
            bucket.params.append(p)
            bucket.nbytes += nbytes
        self.buckets.sort(key=lambda b: "embedding" in b.groups)  # the tied embedding's sum last
        # grad-norm bookkeeping: params grouped by the (size > 1) groups they are sharded over
        self.norm_keys: Dict[Tuple[str, ...], List[torch.nn.Parameter]] = {}
        for p in self.params:
            key = tuple(sorted({g for g in p.meta.sharded_groups() if state.groups[g].size > 1}))
            self.norm_keys.setdefault(key, []).append(p)

    def _fill_missing_grads(self) -> None:
        """A param that took no part in this step (e.g. an expert no token chose) has grad zero
        (a main gradient, bf16 runs, always exists)."""
        for p in self.params:
            if p.grad is None and not has_main_grad(p):
                p.grad = torch.zeros_like(p)

    @torch.no_grad()
    def sync(self) -> None:
        """Average gradients over replicas (see module docstring)."""
        self._fill_missing_grads()
        for bucket in self.buckets:
            grads = [grad_of(p) for p in bucket.params]
            if not bucket.groups:
                torch._foreach_mul_(grads, bucket.scale)
                continue
            flat = torch.cat([g.reshape(-1) for g in grads])
            for name in bucket.groups:
                collectives.all_reduce(flat, self.state.groups[name])
            flat.mul_(bucket.scale)
            offset = 0
            for g in grads:
                g.copy_(flat[offset: offset + g.numel()].view_as(g))
                offset += g.numel()

    @torch.no_grad()
    def grad_norm(self) -> float:
        """Global L2 norm of the (synced) gradient, every parameter counted once; same on all ranks."""
        self._fill_missing_grads()
        device = self.params[0].device if self.params else torch.device("cpu")
        squared = {}
        for key, params in self.norm_keys.items():
            parts = [_squared_norm(p) for p in params if counts_in_norm(p)]
            squared[key] = torch.stack(parts).sum() if parts else torch.zeros((), device=device)
        return reduce_squared_norms(squared, self.state, device)

    @torch.no_grad()
    def clip(self, max_norm: float) -> float:
        """Scale gradients so their global norm is at most `max_norm` (0 = off); return the norm
        before clipping."""
        norm = self.grad_norm()
        if max_norm > 0:
            coef = max_norm / (norm + 1e-6)
            if coef < 1.0:
                torch._foreach_mul_([grad_of(p) for p in self.params], coef)
        return norm
