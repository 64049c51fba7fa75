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

Gradients are flattened into buckets (same groups, scale, dtype, device; at most `bucket_bytes`,
`optimizer.grad_bucket_mb`) so there is one all-reduce per bucket and group, not one per parameter.
With the distributed optimizer (`replicas=False`) the replica sum over dp / edp and the 1/dp_size are
left to its reduce-scatter (training/distributed_optimizer.py); the rest happens here.

Overlap (`optimizer.overlap_grad_reduce`, Megatron-Core DDP's `overlap_grad_reduce`): a bucket's sum
over its replica group (``dp`` for dense, ``edp`` for expert parameters) starts, asynchronously on that
group's side channel (its own communicator: NCCL's own stream; counted as "<kind>/dp_side",
"<kind>/edp_side"), from a post-accumulate-grad hook (`HookedLaunch`) as soon as each of its
parameters has had its last gradient of the iteration: the one of the last of `begin(m)`'s m
backward passes (gradient accumulation: earlier micro-batches only accumulate, Megatron's
`no_sync`). Expert weights' gradients are added outside autograd (the grouped GEMM's dW,
`moe/grouped_gemm.py` `grouped_mm_into_grad`, once per batch part), but the leaf is an input of
each of those autograd nodes, so its accumulator, and the hook, runs once per backward pass after
all of them, with nothing to accumulate: the readiness notification. Buckets start in one fixed
order over both groups (the reverse of the parameters', about backward's), a bucket only after the
ones before it, so every rank issues the same sequence on each communicator and the same
interleaving of the two (NCCL's rule for concurrent communicators); `finish` starts those no hook
started (a parameter that got no gradient) and `sync` waits for each before the other groups' sums
(tp / esp, the tied embedding's), the scale and the copy back, and so before the grad norm,
clipping and the optimizer. The same buckets sum the same numbers: the result is the
non-overlapped path's bit for bit. Expert buckets stay after backward where their gradients get
additions after backward ends (`late_expert_grads`: replicas' Agg, vExpert slot sums, the smart
schedule's per-step backward passes). A gradient hook or an out-of-band addition
(`model/precision.py` `grad_buffer`) that comes after its bucket started raises instead of being
lost. Lancet's deferred dW refuses the option (training/distributed_optimizer.py); the distributed
optimizer starts its reduce-scatters with the same `HookedLaunch`.

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
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from megatron_moe.distributed import collectives
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.precision import fold_grad, grad_dtype, grad_of, has_main_grad
from megatron_moe.moe.balancers import BALANCERS
from megatron_moe.moe.schedules.base import EXCHANGES

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


def late_expert_grads(cfg) -> str:
    """Why expert parameters' gradients get additions after their last hook under `cfg` (their
    buckets then start after backward, module docstring); '' when they do not. Each balancer and the
    smart schedule's exchange declare it (their class attribute `late_expert_grads`)."""
    parts = [BALANCERS.get(cfg.moe.balancer)] + ([EXCHANGES.get("smart")] if cfg.moe.smart_schedule else [])
    return "; ".join(part.late_expert_grads for part in parts if part.late_expert_grads)


class HookedLaunch:
    """Overlap (module docstring): `units`, each (parameters, start: () -> Pending), started from
    post-accumulate-grad hooks during the last of `begin(m)`'s m backward passes, in the given
    order, a unit once its parameters have all had their m-th gradient and the units before it
    started; `finish` starts the rest (same order) and returns every unit's Pending."""

    def __init__(self, units: Sequence[Tuple[List[torch.nn.Parameter], Callable[[], collectives.Pending]]]):
        self.units = list(units)
        self._unit_of = {id(p): i for i, (params, _) in enumerate(self.units) for p in params}
        for params, _ in self.units:
            for p in params:
                p.register_post_accumulate_grad_hook(self._grad_ready)
        self._micro_batches = 0  # backward passes of the armed iteration (`begin`); 0 = hooks idle
        self._counts: Dict[int, int] = {}  # id(param) -> gradients it got in the armed iteration
        self._waiting: List[int] = []  # per unit: parameters still to get their last gradient
        self.pending: List[Optional[collectives.Pending]] = []
        self.started_in_backward = 0  # units the hooks started in the last finished iteration

    def begin(self, micro_batches: int) -> None:
        """Arm the hooks for an iteration of `micro_batches` backward passes (no-op without units)."""
        self._micro_batches = micro_batches if self.units else 0
        self._counts = dict.fromkeys(self._unit_of, 0)
        self._waiting = [len(params) for params, _ in self.units]
        self.pending = []
        self._seal(False)

    def _seal(self, started: bool, units: Optional[Sequence[int]] = None) -> None:
        """Mark the parameters of `units` (default: all) as in a started reduction: model/precision.py
        `grad_buffer` refuses them while they are."""
        for i in range(len(self.units)) if units is None else units:
            for p in self.units[i][0]:
                p.grad_reduce_started = started

    def _grad_ready(self, p: torch.nn.Parameter) -> None:
        """Post-accumulate-grad hook: count `p`'s gradient; start the units that are complete."""
        if not self._micro_batches:
            return
        fold_grad(p)  # bf16: autograd's .grad into the main gradient first, whatever the hooks' order
        count = self._counts[id(p)] = self._counts[id(p)] + 1
        if count > self._micro_batches:
            raise RuntimeError(f"a parameter {tuple(p.shape)} got {count} gradients in {self._micro_batches} backward "
                               "passes: its bucket's reduction already started (optimizer.overlap_grad_reduce)")
        if count == self._micro_batches:
            self._waiting[self._unit_of[id(p)]] -= 1
            while len(self.pending) < len(self.units) and self._waiting[len(self.pending)] == 0:
                self._start()

    def _start(self) -> None:
        self.pending.append(self.units[len(self.pending)][1]())
        self._seal(True, [len(self.pending) - 1])

    def finish(self) -> List[collectives.Pending]:
        """Start the units no hook started, in order; disarm; every unit's Pending (none if unarmed)."""
        if not self._micro_batches:
            return []
        self.started_in_backward = len(self.pending)
        while len(self.pending) < len(self.units):
            self._start()
        self._seal(False)
        self._micro_batches = 0
        return self.pending


@dataclass
class _Bucket:
    params: List[torch.nn.Parameter]
    groups: Tuple[str, ...]  # all-reduce SUM over each, in order
    scale: float  # then multiply by this
    first: int  # index of its first parameter (overlap: buckets start in decreasing order of it)
    nbytes: int = 0
    pending: Optional[collectives.Pending] = None  # overlap: its first group's sum, in flight


def sync_plan(p: torch.nn.Parameter, state: ParallelState, replicas: bool) -> Tuple[Tuple[str, ...], float]:
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
                 bucket_bytes: int = BUCKET_BYTES, replicas: bool = True, overlap: bool = False,
                 overlap_experts: bool = True):
        """`overlap`: start the replica sums from hooks (module docstring); `overlap_experts`: the
        expert buckets' too (False where `late_expert_grads` gives a reason)."""
        self.state = state
        self.params = []
        for name, p in named_params:
            assert hasattr(p, "meta"), f"parameter {name} has no ParamMeta (use make_param)"
            if p.requires_grad:
                self.params.append(p)
        open_buckets: Dict[tuple, _Bucket] = {}
        self.buckets: List[_Bucket] = []
        for index, p in enumerate(self.params):
            groups, scale = sync_plan(p, state, replicas)
            if not groups and scale == 1.0:
                continue
            dtype = grad_dtype(p)  # fp32 main gradients of bf16 parameters
            key = (groups, scale, dtype, p.device)
            nbytes = p.numel() * dtype.itemsize
            bucket = open_buckets.get(key)
            if bucket is None or bucket.nbytes + nbytes > bucket_bytes:
                bucket = open_buckets[key] = _Bucket([], groups, scale, index)
                self.buckets.append(bucket)
            bucket.params.append(p)
            bucket.nbytes += nbytes
        self.buckets.sort(key=lambda b: "embedding" in b.groups)  # the tied embedding's sum last
        # overlap: the buckets hooks start (their first sum, over dp or edp), in the order they start
        hooked = {"dense": overlap, "expert": overlap and overlap_experts}
        self.launch_order = sorted([b for b in self.buckets if hooked[b.params[0].meta.kind]
                                    and b.groups[:1] == (REPLICA_GROUP[b.params[0].meta.kind],)
                                    and not any(hasattr(p, "vexpert_slots") for p in b.params)],
                                   key=lambda b: -b.first)  # (vExperts: slot sums after backward)
        self.launch = HookedLaunch([(b.params, lambda b=b: self._start(b)) for b in self.launch_order])
        self.sink = collectives.TimeSink()  # {"all_reduce": [exposed, total]} of the started buckets
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

    # -- overlap (module docstring) ------------------------------------------------------------------
    def begin(self, micro_batches: int) -> None:
        """Arm the hooks for an iteration of `micro_batches` backward passes (no-op without overlap)."""
        self.launch.begin(micro_batches)
        self.sink = collectives.TimeSink()

    @property
    def started_in_backward(self) -> int:
        """Buckets the hooks started in the last synced iteration."""
        return self.launch.started_in_backward

    def _start(self, bucket: _Bucket) -> collectives.Pending:
        """Start `bucket`'s sum over its first group (dp / edp) on that group's side channel."""
        flat = torch.cat([grad_of(p).reshape(-1) for p in bucket.params])
        bucket.pending = collectives.all_reduce_async(flat, self.state.groups[bucket.groups[0]].side_channel(),
                                                      sink=self.sink)
        return bucket.pending

    @torch.no_grad()
    def sync(self) -> None:
        """Average gradients over replicas (module docstring); with overlap, start the buckets no hook
        started, in the same order, and wait for each."""
        self._fill_missing_grads()
        self.launch.finish()
        for bucket in self.buckets:
            grads = [grad_of(p) for p in bucket.params]
            if not bucket.groups:
                torch._foreach_mul_(grads, bucket.scale)
                continue
            if bucket.pending is not None:  # started by a hook: its sum over dp is in flight
                flat, groups = bucket.pending.wait(), bucket.groups[1:]
                bucket.pending = None
            else:
                flat, groups = torch.cat([g.reshape(-1) for g in grads]), bucket.groups
            for name in groups:
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
