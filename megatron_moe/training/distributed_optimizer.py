"""Distributed optimizer, ZeRO stage 1 (`optimizer.distributed: true`; Rajbhandari et al., "ZeRO:
Memory Optimizations Toward Training Trillion Parameter Models", SC'20, §5.1 P_os; Megatron-LM's
DistributedOptimizer).

AdamW's state is sharded over the replicas of each parameter: over ``dp`` for dense parameters, over
``edp`` for expert parameters (the ranks holding the same expert shard). The parameters of one
replica group with the same weight decay, dtype, device, norm key and need of `GradSync` sums
(tp / esp, tied embedding), in order, are flat buffers [N] of at most `optimizer.grad_bucket_mb`
of gradients each (Megatron's buckets), padded to a multiple of the group size r; member i owns
elements [i N / r, (i + 1) N / r) of each. The model's
parameters become views into that buffer. In fp32 runs this rank's slice of it is what AdamW steps
(the parameters are their own master weights), so only the moments are held per shard; in bf16
runs (`training.precision: bf16`, docs/precision.md) the flat buffer is bf16 and this rank holds an
fp32 master copy of its slice next to the moments (Megatron-LM's DistributedOptimizer: fp32 main
params per shard), which AdamW steps and which is copied back into the bf16 slice. One iteration:

1. backward accumulates full gradients into one flat gradient buffer per flat parameter buffer
   (fp32 runs: the parameters' `.grad` are views into it, set by `zero_grad`; bf16 runs: it is
   fp32 and the parameters' `main_grad` are views into it, model/precision.py);
2. `GradSync(replicas=False)` averages over the compute groups (tp / esp) and sums the tied
   embedding's copies (training/grads.py);
3. each flat gradient is reduce-scattered over its replica group and scaled by 1 / dp_size: this
   rank's shard of the global-batch mean gradient (kind `grad_reduce_scatter`; the tensor form,
   `reduce_scatter_tensor`: NCCL's list form would first copy the whole buffer). With
   `optimizer.overlap_grad_reduce` a buffer's reduce-scatter starts during the last micro-batch's
   backward, on its group's side channel (counted under "dp_side" / "edp_side"), from the hooks
   of `training/grads.py` `HookedLaunch` once its parameters' gradients are final (those that
   need GradSync's sums first, and expert buffers under `late_expert_grads`, start here); every
   one is waited for here, before the norm and the step (Megatron's distributed optimizer);
4. the global grad norm adds each shard element once (over the replica group, the groups the
   parameters are sharded over, and ``pp``); clipping scales the shards;
5. AdamW (torch's fused kernel) steps the shards (bf16: the fp32 master shards, then copied into the
   bf16 slice): element-wise, so the same numbers as a full update;
6. each flat parameter buffer is all-gathered over its replica group, in place (kind
   `param_all_gather`; `all_gather_into_tensor` with this rank's slice as input; bf16 runs gather bf16).

Exact: step 3 sums the numbers the all-reduce sums; step 5 is element-wise.
Memory: the moments take 8 bytes per parameter element / r (+ padding) instead of 8 (bf16: moments
and master 12 / r, plus 2 for the bf16 weight and 4 for the fp32 gradient buffer).

Checkpoints (training/checkpoint.py): `sharded_states` cuts each parameter's part of this rank's
shard into boxes of the parameter's shape (`flat_range_boxes`), saved under the same global names
and offsets as unsharded moments: any layout, sharded or not, loads any other.
vExpert balancers (FlexMoE, EPLB) move AdamW state between ranks: refused by the config check.
This module also holds the checks of `optimizer.overlap_grad_reduce` and its side channels on ``dp``
and ``edp`` (training/grads.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

import torch

from megatron_moe.config.schema import OptimizerConfig
from megatron_moe.distributed import collectives
from megatron_moe.distributed.parallel_state import SIDE_CHANNELS, Group, ParallelState
from megatron_moe.model.precision import attach_main_grads
from megatron_moe.training.grads import (GradSync, HookedLaunch, REPLICA_GROUP, counts_in_norm, late_expert_grads,
                                         reduce_squared_norms, sync_plan)
from megatron_moe.config.errors import ConfigError
from megatron_moe.config.validate import section_check

DECAYED_ROLES = frozenset({"weight", "embedding"})  # ParamMeta roles that weight decay applies to (training/optimizer.py)


def fused_ok(params) -> bool:
    """Can torch's fused AdamW kernel take `params` (float tensors on CPU or CUDA)?"""
    return bool(params) and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)


GRAD_KIND = "grad_reduce_scatter"
PARAM_KIND = "param_all_gather"
Box = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (offsets, sizes) inside a tensor


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> List[Box]:
    """Elements [start, stop) of a row-major tensor of `shape` as few boxes (offsets, sizes), in
    order; each box is a contiguous run of the flat tensor."""
    shape = tuple(shape)
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    (r0, o0), (r1, o1) = divmod(start, inner), divmod(stop, inner)
    if r0 == r1:
        return [((r0,) + off, (1,) + size) for off, size in flat_range_boxes(shape[1:], o0, o1)]
    boxes = []
    if o0:
        boxes += [((r0,) + off, (1,) + size) for off, size in flat_range_boxes(shape[1:], o0, inner)]
        r0 += 1
    if r1 > r0:
        boxes.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + shape[1:]))
    if o1:
        boxes += [((r1,) + off, (1,) + size) for off, size in flat_range_boxes(shape[1:], 0, o1)]
    return boxes


def _ravel(offsets: Sequence[int], shape: Sequence[int]) -> int:
    index = 0
    for o, n in zip(offsets, shape):
        index = index * n + o
    return index


@dataclass
class _FlatGroup:
    """Parameters viewed as one flat buffer, sharded over a replica group."""

    names: List[str]
    params: List[torch.nn.Parameter]
    group: Group
    norm_key: Tuple[str, ...]
    decay: bool
    first: int = 0  # index of its first parameter among the model's (overlap: started in decreasing order)
    synced: bool = False  # its parameters need GradSync's sums (tp / esp, tied embedding) before the reduce-scatter
    starts: List[int] = field(default_factory=list)  # each parameter's offset in the flat buffer
    flat: torch.Tensor = None  # [N padded]
    grad: torch.Tensor = None  # [N padded] fp32: the parameters' .grad (bf16 runs: main_grad) are views into it
    shard: torch.nn.Parameter = None  # what AdamW steps: flat[lo:hi] (fp32), or its fp32 master copy (bf16)
    lo: int = 0
    hi: int = 0

    @property
    def padded_numel(self) -> int:
        """N: the parameters' elements, padded to a multiple of the group size."""
        total = sum(p.numel() for p in self.params)
        return -(-total // self.group.size) * self.group.size

    def build(self) -> None:
        self.starts = [0]
        for p in self.params:
            self.starts.append(self.starts[-1] + p.numel())
        total = self.starts.pop()
        size = self.padded_numel
        p0 = self.params[0]
        # filled parameter by parameter, each old tensor freed as it goes (no second copy of them all)
        self.flat = torch.empty(size, dtype=p0.dtype, device=p0.device)
        self.flat[total:].zero_()
        with torch.no_grad():
            for p, start in zip(self.params, self.starts):
                self.flat[start: start + p.numel()].copy_(p.detach().reshape(-1))
                p.data = self.flat[start: start + p.numel()].view_as(p)
        self.grad = torch.zeros_like(self.flat, dtype=torch.float32)  # fp32 main gradients in bf16 runs
        per_rank = size // self.group.size
        self.lo, self.hi = self.group.rank * per_rank, (self.group.rank + 1) * per_rank
        if self.has_master:
            self.shard = torch.nn.Parameter(self.flat[self.lo: self.hi].float())
            attach_main_grads(self.params, self.grad, self.starts)
        else:
            self.shard = torch.nn.Parameter(self.flat[self.lo: self.hi])

    @property
    def has_master(self) -> bool:
        """bf16 parameters: the shard AdamW steps is an fp32 master copy (module docstring)."""
        return self.params[0].dtype != torch.float32

    def pieces(self):
        """(parameter index, its local flat range [a, b) inside this rank's shard) for every
        parameter that has elements in the shard."""
        for i, (p, start) in enumerate(zip(self.params, self.starts)):
            a, b = max(start, self.lo), min(start + p.numel(), self.hi)
            if a < b:
                yield i, a - start, b - start


def flat_groups(named: Sequence[Tuple[str, torch.nn.Parameter]], state: ParallelState,
                bucket_bytes: float = math.inf) -> List[_FlatGroup]:
    """The flat buffers (not built) of these parameters: per replica group, weight decay, dtype,
    device, norm key and need of GradSync's sums, at most `bucket_bytes` of fp32 gradients each (one
    parameter may exceed it), in first-parameter order (the cluster simulator sizes its collectives by them)."""
    out: List[_FlatGroup] = []
    open_flats: Dict[tuple, _FlatGroup] = {}
    for index, (name, p) in enumerate(named):
        assert not hasattr(p, "vexpert_slots"), "optimizer.distributed with vExperts: validate the config first"
        replica = state.groups[REPLICA_GROUP[p.meta.kind]]
        norm_key = tuple(sorted({g for g in p.meta.sharded_groups() + [replica.name] if state.groups[g].size > 1}))
        decay = p.meta.role in DECAYED_ROLES
        synced = sync_plan(p, state, replicas=False) != ((), 1.0)
        key = (replica.name, decay, p.dtype, str(p.device), norm_key, synced)
        flat = open_flats.get(key)
        if flat is None or (sum(q.numel() for q in flat.params) + p.numel()) * 4 > bucket_bytes:
            flat = open_flats[key] = _FlatGroup([], [], replica, norm_key, decay, index, synced)
            out.append(flat)
        flat.names.append(name)
        flat.params.append(p)
    return out


def hooked_flats(flats: Sequence[_FlatGroup], overlap: bool, overlap_experts: bool) -> List[_FlatGroup]:
    """The buffers whose reduce-scatters the hooks start (step 3, overlapped), in start order."""
    hooked = {"dense": overlap, "expert": overlap and overlap_experts}
    return sorted([f for f in flats if hooked[f.params[0].meta.kind] and not f.synced and f.group.size > 1],
                  key=lambda f: -f.first)


class DistributedOptimizer:
    """AdamW over this rank's shards (module docstring). The trainer calls `sync()`, `clip()`,
    `step()` where it calls GradSync's and the optimizer's; `param_groups` carry the lr."""

    def __init__(self, model: torch.nn.Module, cfg: OptimizerConfig, state: ParallelState,
                 overlap_experts: bool = True):
        """`overlap_experts`: with `cfg.overlap_grad_reduce`, the expert buffers' reduce-scatters
        start from hooks too (False where `late_expert_grads` gives a reason)."""
        self.state = state
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        bucket_bytes = int(cfg.grad_bucket_mb * 2 ** 20)
        self.grad_sync = GradSync(named, state, bucket_bytes=bucket_bytes, replicas=False)
        self.flats = flat_groups(named, state, bucket_bytes)
        for flat in self.flats:
            flat.build()
        self.launch_order = hooked_flats(self.flats, cfg.overlap_grad_reduce, overlap_experts)
        self.launch = HookedLaunch([(f.params, lambda f=f: self._reduce_scatter(f)) for f in self.launch_order])
        self._pending: Dict[int, collectives.Pending] = {}  # id(flat) -> its reduce-scatter started by a hook
        self.sink = collectives.TimeSink()  # {GRAD_KIND: [exposed, total]} of the overlapped reduce-scatters
        shards = [f.shard for f in self.flats]
        self.adam = torch.optim.AdamW(
            [{"params": [f.shard for f in self.flats if f.decay], "weight_decay": cfg.weight_decay},
             {"params": [f.shard for f in self.flats if not f.decay], "weight_decay": 0.0}],
            lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
            fused=True if fused_ok(shards) else None)

    @property
    def param_groups(self):
        return self.adam.param_groups

    @property
    def state_tensors(self):
        """AdamW's per-shard state (`optimizer.state` of a torch optimizer)."""
        return self.adam.state

    def begin(self, micro_batches: int) -> None:
        """Arm the hooks that start the reduce-scatters (`optimizer.overlap_grad_reduce`)."""
        self.launch.begin(micro_batches)
        self._pending, self.sink = {}, collectives.TimeSink()

    @property
    def started_in_backward(self) -> int:
        """Reduce-scatters the hooks started in the last synced iteration."""
        return self.launch.started_in_backward

    def _reduce_scatter(self, flat: _FlatGroup) -> collectives.Pending:
        """Start `flat`'s reduce-scatter on its group's side channel (step 3, overlapped)."""
        pending = self._pending[id(flat)] = collectives.reduce_scatter_async(
            flat.grad, flat.group.side_channel(), kind=GRAD_KIND, sink=self.sink)
        return pending

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffers; backward accumulates into the parameters' views of them."""
        for flat in self.flats:
            flat.shard.grad = None
            flat.grad.zero_()
            for p, start in zip(flat.params, flat.starts):
                p.grad = None if flat.has_master else flat.grad[start: start + p.numel()].view_as(p)

    # -- gradients ----------------------------------------------------------------------------------
    @torch.no_grad()
    def sync(self) -> None:
        """Steps 2-3: compute-group averages and tied sums, then this rank's reduce-scattered shard."""
        self.grad_sync.sync()
        self.launch.finish()
        for flat in self.flats:
            pending = self._pending.pop(id(flat), None)  # started by a hook: in flight on the side channel
            shard = pending.wait() if pending else collectives.reduce_scatter(flat.grad, flat.group, kind=GRAD_KIND)
            flat.shard.grad = shard.mul_(1.0 / self.state.dp_size)

    @torch.no_grad()
    def grad_norm(self) -> float:
        squared: Dict[Tuple[str, ...], torch.Tensor] = {}
        device = self.flats[0].flat.device if self.flats else torch.device("cpu")
        for flat in self.flats:
            grad = flat.shard.grad.float()
            total = squared.get(flat.norm_key, torch.zeros((), device=device))
            for i, a, b in flat.pieces():
                if counts_in_norm(flat.params[i]):
                    start = flat.starts[i] - flat.lo
                    total = total + grad[start + a: start + b].pow(2).sum()
            squared[flat.norm_key] = total
        return reduce_squared_norms(squared, self.state, device)

    @torch.no_grad()
    def clip(self, max_norm: float) -> float:
        """Step 4: scale the shards' gradients to a global norm of at most `max_norm` (0 = off);
        returns the norm before clipping."""
        norm = self.grad_norm()
        if max_norm > 0:
            coef = max_norm / (norm + 1e-6)
            if coef < 1.0:
                torch._foreach_mul_([f.shard.grad for f in self.flats], coef)
        return norm

    # -- update ----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """Steps 5-6: AdamW on the shards, then every rank gets every replica-group member's shard."""
        self.adam.step()
        self.publish()

    def masters_to_params(self) -> None:
        """After loading the master shards (checkpoints): the bf16 parameters from them."""
        self.publish()

    @torch.no_grad()
    def publish(self) -> None:
        """The shards into the parameters: bf16 runs copy each fp32 master shard into this rank's bf16
        slice; then every rank gets every replica-group member's slice (also after loading masters)."""
        for flat in self.flats:
            if flat.has_master:
                flat.flat[flat.lo: flat.hi].copy_(flat.shard)
            if flat.group.size > 1:
                collectives.all_gather(flat.flat[flat.lo: flat.hi], flat.group, kind=PARAM_KIND, out=flat.flat)

    # -- checkpoints ----------------------------------------------------------------------------------
    def reset_state(self) -> None:
        """Zero moments and step 0 for every shard (what a checkpoint's moments are loaded into)."""
        for flat in self.flats:
            self.adam.state[flat.shard] = {
                "step": torch.zeros((), dtype=torch.float32, device=flat.flat.device),
                "exp_avg": torch.zeros_like(flat.shard), "exp_avg_sq": torch.zeros_like(flat.shard)}

    def sharded_states(self) -> Dict[str, dict]:
        """{parameter name: {"exp_avg" | "exp_avg_sq" (| "master" in bf16 runs): [(box view, local
        offsets)], "step": scalar}}: this rank's part of each parameter's moments (and fp32 master),
        as boxes of the parameter's local shape (views into the shard state: loading into them fills
        it). `load_steps` takes the steps back, `publish` the masters."""
        if not all(flat.shard in self.adam.state for flat in self.flats):
            self.reset_state()
        out: Dict[str, dict] = {}
        self._steps = {}
        for flat in self.flats:
            st = self.adam.state[flat.shard]
            for name in flat.names:
                self._steps[name] = st["step"].detach().reshape(()).float().clone()
                out[name] = {"exp_avg": [], "exp_avg_sq": [], "step": self._steps[name]}
                if flat.has_master:
                    out[name]["master"] = []
            tensors = {"exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"]}
            if flat.has_master:
                tensors["master"] = flat.shard.data
            for i, a, b in flat.pieces():
                p, base = flat.params[i], flat.starts[i] - flat.lo
                for offsets, sizes in flat_range_boxes(p.shape, a, b):
                    begin = base + _ravel(offsets, p.shape)
                    for key, tensor in tensors.items():
                        view = tensor[begin: begin + math.prod(sizes)].view(sizes)
                        out[flat.names[i]][key].append((view, offsets))
        return out

    def load_steps(self) -> None:
        """After loading `sharded_states`' tensors: each shard's step from its first parameter's."""
        for flat in self.flats:
            self.adam.state[flat.shard]["step"].copy_(self._steps[flat.names[0]])


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of optimizer state this rank holds (AdamW moments and steps; fp32 masters in bf16 runs)."""
    states = optimizer.state_tensors if isinstance(optimizer, DistributedOptimizer) else optimizer.state
    total = sum(t.numel() * t.element_size() for st in states.values() for t in st.values() if torch.is_tensor(t))
    if isinstance(optimizer, DistributedOptimizer):
        total += sum(f.shard.numel() * f.shard.element_size() for f in optimizer.flats if f.has_master)
    return total


@section_check("optimizer.distributed")
def _check_distributed(cfg, world_size: int) -> None:
    if cfg.optimizer.distributed and cfg.moe.balancer in ("flexmoe", "eplb"):
        raise ConfigError(f"optimizer.distributed=true does not work with moe.balancer={cfg.moe.balancer}: its "
                          "vExperts move AdamW state between ranks, which the distributed optimizer shards")


@section_check("optimizer.overlap_grad_reduce")
def _check_overlap(cfg, world_size: int) -> None:
    opt = cfg.optimizer
    if not opt.grad_bucket_mb > 0:
        raise ConfigError(f"optimizer.grad_bucket_mb={opt.grad_bucket_mb} must be > 0")
    if opt.overlap_grad_reduce and cfg.moe.lancet.defer_wgrad:
        raise ConfigError("optimizer.overlap_grad_reduce=true does not work with moe.lancet.defer_wgrad=true: deferred "
                          "weight gradients land after the hooks that start their buckets' reduction; turn one off")


@SIDE_CHANNELS.register("grad_reduce")
def _grad_reduce_channels(cfg) -> list:
    """The gradient buckets reduced during backward get their own communicators: over ``dp`` (dense)
    and ``edp`` (experts, unless `late_expert_grads`)."""
    if not cfg.optimizer.overlap_grad_reduce:
        return []
    return ["dp"] if late_expert_grads(cfg) else ["dp", "edp"]
