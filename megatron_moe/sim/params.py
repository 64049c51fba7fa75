"""What the trainer communicates after the micro-batches, per pipeline stage, sized from the model
itself (`Trainer.train_step`, training/grads.py, training/distributed_optimizer.py).

The model (GPT) is built on the meta device (shapes and `ParamMeta` only: no memory, no
initialization) for the first rank of every stage; every rank of a stage holds the same shapes.
Then, in the order the trainer runs them (fp32 unless said otherwise, kind "all_reduce" unless said):

1. gradient sync: `GradSync`'s buckets (at most `optimizer.grad_bucket_mb` each), one all-reduce per
   bucket and group in order: the replicas over `dp` (dense) / `edp` (experts), the `tp` / `esp`
   averages of parameters replicated there, the tied word embedding's sum over `embedding` (first
   and last stage) last. With `optimizer.distributed`: `GradSync(replicas=False)`'s buckets, then
   every flat buffer (`flat_groups`, at most `optimizer.grad_bucket_mb` each) reduce-scattered over
   its replica group (kind "grad_reduce_scatter", the buffer padded to a multiple of the group).
   With `optimizer.overlap_grad_reduce` the replica sums the hooks start count under their group's
   side channel ("<kind>/dp_side", "<kind>/edp_side"); their time is modelled as after backward;
2. the global grad norm: `norm_reductions` (one element per norm key, per group), then one over `pp`;
3. the loss sums: 4 fp64 (lm, aux, binary, mtp) over `pp`, then over `dp` (`Trainer.mean_over_dp`);
4. with `optimizer.distributed`, after the step, every flat buffer all-gathered over its replica
   group when it has more than one member (kind "param_all_gather").

The vExperts' gradient sum (before 1) and moves (after 4) are the balancers' (`sim/replica_traffic.py`).
Not modelled: the optimizer step's computation. `end_ops` gives a stage's ops; those over the
groups across stages (`embedding`, `pp`) are timed across the stages by `sim/pipeline.run_stages`.
"""
from __future__ import annotations

from dataclasses import dataclass
from dataclasses import replace
from typing import List, Optional, Tuple

import torch

from megatron_moe.config.schema import Config
from megatron_moe.distributed.parallel_state import ParallelState, RankLayout
from megatron_moe.sim.ops import Op, OpBuilder
from megatron_moe.training.distributed_optimizer import GRAD_KIND, PARAM_KIND, flat_groups, hooked_flats
from megatron_moe.training.grads import GradSync, late_expert_grads, norm_reductions

LOSS_SUMS = 4  # Trainer.forward_backward's [lm_loss, aux_loss, binary_loss, mtp_loss], fp64 in mean_over_dp


@dataclass
class StageParams:
    """One stage's sync plan: elements per rank, fp32."""

    buckets: List[Tuple[Tuple[str, ...], int, bool]]  # GradSync: (groups all-reduced in order, elements, hooked)
    norm_keys: List[Tuple[str, ...]]  # the grad norm's keys (groups each key's pieces are disjoint over)
    flats: List[Tuple[str, int, bool]]  # optimizer.distributed: (replica group, padded elements, hooked)

    @classmethod
    def of(cls, cfg: Config, layout: RankLayout, stage: int) -> "StageParams":
        from megatron_moe.model.gpt import GPTMoEModel  # lazy: the model package builds on the MoE package

        state = ParallelState.build(layout, stage * layout.stage_size)
        with torch.device("meta"):
            named = [(n, p) for n, p in GPTMoEModel(cfg, state).named_parameters() if p.requires_grad]
        opt = cfg.optimizer  # as the trainer builds them (training/trainer.py)
        bucket_bytes, overlap = int(opt.grad_bucket_mb * 2 ** 20), opt.overlap_grad_reduce
        experts = not late_expert_grads(cfg)  # expert buckets from the hooks too
        sync = GradSync(named, state, bucket_bytes, replicas=not opt.distributed, overlap=overlap,
                        overlap_experts=experts)
        flats = flat_groups(named, state, bucket_bytes) if opt.distributed else []
        hooked = set(map(id, sync.launch_order + hooked_flats(flats, overlap, experts)))
        buckets = [(b.groups, sum(p.numel() for p in b.params), id(b) in hooked) for b in sync.buckets if b.groups]
        norm_keys = sorted({f.norm_key for f in flats}) if opt.distributed else sorted(sync.norm_keys)
        return cls(buckets, norm_keys, [(f.group.name, f.padded_numel, id(f) in hooked) for f in flats])


def end_ops(b: OpBuilder, params: StageParams, first_half: bool) -> List[Op]:
    """A stage's collectives before the optimizer step (`first_half`: steps 1-3 of the module
    docstring) or after it (step 4)."""
    sizes = b.world.group_size
    if not first_half:
        return [b.collective("param_all_gather", PARAM_KIND, group, n, b.widths.weight, "all_gather")
                for group, n, _ in params.flats if sizes[group] > 1]
    ops: List[Optional[Op]] = []
    for groups, n, hooked in params.buckets:
        ops += [_side(_all_reduce(b, f"grad_allreduce_{g}", g, n, 4), hooked and i == 0) for i, g in enumerate(groups)]
    ops += [_side(b.collective("grad_reduce_scatter", GRAD_KIND, group, n, 4, "all_gather"), hooked)  # an all-gather's
            for group, n, hooked in params.flats if sizes[group] > 1]  # volume
    ops += [_all_reduce(b, "grad_norm", group, len(rows), 4) for group, rows in norm_reductions(params.norm_keys)]
    ops += [_all_reduce(b, "grad_norm", "pp", 1, 4), _all_reduce(b, "loss_allreduce", "pp", LOSS_SUMS, 8),
            _all_reduce(b, "loss_allreduce", "dp", LOSS_SUMS, 8)]
    return [op for op in ops if op is not None]


def _side(op: Optional[Op], hooked: bool) -> Optional[Op]:
    """`op` counted on its group's side channel when a gradient hook started it (overlap)."""
    if op is None or not hooked:
        return op
    return replace(op, traffic=[replace(t, key=f"{t.key}_side") for t in op.traffic])


def _all_reduce(b: OpBuilder, name: str, group: str, elements: int, element_bytes: int) -> Optional[Op]:
    """An all-reduce over `group` (none on a group of one: the collectives skip it, count nothing)."""
    if b.world.group_size[group] == 1:
        return None
    return b.collective(name, "all_reduce", group, elements, element_bytes, "all_reduce")
