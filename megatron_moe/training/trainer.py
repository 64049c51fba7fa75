"""The training loop: micro-batches with gradient accumulation, grad sync + clipping, AdamW,
warmup + cosine LR, periodic evaluation, metrics.

One iteration consumes one global batch. Data-parallel rank d runs the micro-batches j of it with
j % dp == d (`data/batches.py`) and back-propagates (lm_loss + aux_loss) / num_local_micro_batches
for each; `GradSync` then averages over replicas, so every layout computes the gradient of the same
global-batch mean loss. The reported loss is the mean of lm_loss over all the global batch's
micro-batches (all-reduced over dp): identical on every rank and every layout. Models with a
binary head (BERT) add its loss to the objective and report it as `binary_loss`; multi-token
prediction (`model.mtp_depth`, model/mtp.py) adds `training.mtp_loss_weight` x its loss (1/D sum of
the depths' cross-entropies) and reports that loss as `mtp_loss`; `loss` stays the LM loss.

The data builder (`datasets(cfg) -> (train, valid)`, GPT by default) follows the model class;
global batch i is samples [i*B, (i+1)*B) of the seed-shuffled dataset (`data/batches.py`).

Pipeline stages (`parallel.pipeline` > 1): the micro-batches run through this rank's stage by the
configured schedule (training/pipeline.py); a stage reports its part of the loss sums (the last
stage the lm and binary losses, every stage its MoE aux losses), summed over ``pp``. With one stage
the schedule is the plain loop: forward j, backward j. `optimizer.distributed` shards AdamW's state
(training/distributed_optimizer.py); it then syncs and clips the gradients itself. With
`optimizer.overlap_grad_reduce` the buckets' sums over dp / edp (ZeRO-1: reduce-scatters) start from
gradient hooks during the last micro-batch's backward (`GradSync.begin`, training/grads.py).

Precision (docs/precision.md): fp32, or bf16 as Megatron-LM's `--bf16`: bf16 parameters and
activations (model/precision.py), fp32 main gradients accumulated over the micro-batches, AdamW on
fp32 master weights copied back into the bf16 parameters once per step (training/mixed_precision.py,
or sharded with the moments under `optimizer.distributed`).
"""
from __future__ import annotations

import json
import math
import os
import resource
from typing import Callable, Dict, List, Optional, Tuple

import torch

from megatron_moe.config import Config, save_config
from megatron_moe.config.registry import Hooks
from megatron_moe.data.batches import Batch, collate, global_batch, rank_micro_batches
from megatron_moe.distributed import collectives
from megatron_moe.distributed.launch import default_device
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.training.completion import clear_complete_marker, read_complete_marker, write_complete_marker
from megatron_moe.training.distributed_optimizer import PARAM_KIND, DistributedOptimizer, optimizer_state_bytes
from megatron_moe.training.grads import GradSync, late_expert_grads
from megatron_moe.training.lr import lr_schedule
from megatron_moe.moe.expert_bias import update_expert_biases
from megatron_moe.moe.stats import IterationMoEStats
from megatron_moe.moe.vexpert_moves import MOVE_KIND
from megatron_moe.moe.schedules import A2A_KINDS
from megatron_moe.training.failures import CheckpointError, NonFiniteError, StopRequest, all_finite, request_requeue
from megatron_moe.training.metrics import MetricsLogger, PhaseTimer, Record, layer_load_metrics, load_imbalance
from megatron_moe.training.optimizer import build_optimizer
from megatron_moe.training.pipeline import ChunkOutput, PipelineRunner
from megatron_moe.training.pipeline_schedules import expected_bubble
from megatron_moe.training.resume import check_resume, nothing_to_train
from megatron_moe.model.precision import cast_params_
from megatron_moe.model.transformer import moe_layer_flags
from megatron_moe.perf import timing
from megatron_moe.training.calibrate import resolve_hardware_profile


def training_device(cfg: Config) -> torch.device:
    return default_device(cfg.parallel.backend)


# per-MoE-layer time columns of `IterationMoEStats.timing`, in metrics.jsonl (ms)
TIMING_KEYS = ("plan_ms", "trans_exposed_ms", "trans_total_ms", "agg_exposed_ms", "agg_total_ms")
# communication of an iteration that runs after its byte / time snapshot (vExpert moves, ZeRO's all-gather)
LATE_KINDS = (MOVE_KIND, PARAM_KIND)
# trainer -> an evaluator with `due(iteration)` and `run()` -> the record's `lm_eval` entry: lm-eval tasks
# during training (evaluation.lm_eval_tasks), filled by evaluation/during_training.py (a floor above)
TRAINING_EVALS: Hooks = Hooks("training evaluation", ("evaluation.lm_eval_tasks",))


class Trainer:
    def __init__(self, cfg: Config, state: ParallelState, model_cls: Optional[type] = None,
                 datasets: Optional[Callable] = None):
        if model_cls is None:
            from megatron_moe.model.gpt import GPTMoEModel as model_cls
        if datasets is None:
            from megatron_moe.data.datasets import build_gpt_datasets_from_config as datasets
        tr = cfg.training
        self.device = training_device(cfg)
        # auto / fastermoe without perf.hardware_profile: calibrate on these ranks (or reuse the cache)
        cfg = resolve_hardware_profile(cfg, state, self.device)
        self.cfg, self.state = cfg, state
        torch.manual_seed(tr.seed + state.dp.rank)  # same stream on TP ranks, distinct per data replica
        self.model = cast_params_(model_cls(cfg, state).to(self.device), tr.precision)
        overlap_experts = not late_expert_grads(cfg)  # overlap_grad_reduce: expert buckets from hooks too
        self.optimizer = build_optimizer(self.model, cfg.optimizer, state, compiled=tr.compile,
                                         overlap_experts=overlap_experts)
        self.learning_rate = lr_schedule(cfg)  # iteration -> LR: warmup, decay until training.lr_decay_iters
        if isinstance(self.optimizer, DistributedOptimizer):
            self.grads = self.optimizer  # reduce-scatters into its shards, norm and clip over them
        else:
            opt = cfg.optimizer  # overlap_grad_reduce: buckets summed over dp / edp from gradient hooks
            self.grads = GradSync(list(self.model.named_parameters()), state,
                                  bucket_bytes=int(opt.grad_bucket_mb * 2 ** 20), overlap=opt.overlap_grad_reduce,
                                  overlap_experts=overlap_experts)
        self.train_data, self.valid_data = datasets(cfg)
        self.has_binary_head = self.model.has_binary_loss  # BERT's sentence-order / next-sentence head
        self.num_micro_batches = tr.global_batch_size // (tr.micro_batch_size * state.dp_size)  # per rank
        self.timer = PhaseTimer(self.device)  # forward / backward / optimizer seconds of the iteration
        self.pipeline = PipelineRunner(cfg, state, self.device, self.timer)
        self.first_of_last_stage = (state.pp_size - 1) * state.layout.stage_size  # rank 0 without pipeline stages
        # any stage's MoE layers hold vExpert slots (their metrics are gathered over the stages)
        self.uses_vexperts = self.any_stage(any(layer.experts.slot_table is not None
                                                for layer in self.model.moe_layers()))
        self.skipped_iterations = 0  # non-finite updates dropped (training.on_nonfinite=skip)
        self.routed_per_source = None  # Long[dp, moe layers, E + 1] of the last iteration: counts | dropped
        self.routed_per_forward = None  # Long[dp, F, moe layers, E] of the last iteration (routing traces)
        self.vexpert_slots = None  # per MoE layer (index, Int[ep, V]): the vExpert placement after the last iteration
        self.latest_moe = None  # IterationMoEStats of the last train_step (step_details reduces it)
        self.loaded_from = None  # the checkpoint `load_checkpoint` resumed

    # -- data ---------------------------------------------------------------------------------
    def micro_batches(self, dataset, index: int) -> List[Batch]:
        """This rank's micro-batches of global batch `index`, on the training device."""
        tr = self.cfg.training
        parts = rank_micro_batches(global_batch(index, tr.global_batch_size), tr.micro_batch_size,
                                   self.state.dp_size, self.state.dp.rank)
        return [{k: t.to(self.device) for k, t in collate(dataset, p).items()} for p in parts]

    def any_stage(self, flag: bool) -> bool:
        """Collective over ``pp``: is `flag` true on some pipeline stage?"""
        return bool(collectives.all_reduce(torch.tensor([float(flag)], device=self.device), self.state.pp, op="max"))

    def mean_over_dp(self, local_sums: torch.Tensor, count_per_rank: int) -> List[float]:
        """Per-rank sums over micro-batches (each pipeline stage its part) -> means over all
        data-parallel micro-batches."""
        total = collectives.all_reduce(local_sums.detach().double().clone(), self.state.pp)
        total = collectives.all_reduce(total, self.state.dp)
        return (total / (count_per_rank * self.state.dp_size)).tolist()

    # -- one iteration --------------------------------------------------------------------------
    def forward_backward(self, index: int) -> Tuple[torch.Tensor, Optional[IterationMoEStats]]:
        """Accumulate gradients of global batch `index` (0-based). Returns this rank's
        ([lm_loss, aux_loss, binary_loss, mtp_loss] sums over its micro-batches, MoE stats summed over them or None)."""
        sums = torch.zeros(4, device=self.device)
        batches = self.micro_batches(self.train_data, index)
        stats: Dict[int, list] = {}  # micro-batch -> its MoE layers' stats, chunk after chunk
        zero = torch.zeros((), device=self.device)

        def forward_step(chunk: int, mb: int, hidden: Optional[torch.Tensor]) -> ChunkOutput:
            out = self.model(**batches[mb], chunk=chunk, hidden=hidden)
            stats.setdefault(mb, []).extend(out.moe_stats)
            if out.hidden is not None:  # a chunk before the model's last: its aux losses only
                sums[1] += out.aux_loss.detach().float()
                return ChunkOutput(out.hidden, out.aux_loss / self.num_micro_batches)
            lm_loss = out.lm_loss
            if index + 1 == self.cfg.training.inject_nan_at and self.state.rank == self.first_of_last_stage:
                lm_loss = lm_loss * float("nan")  # test-only hook (training.inject_nan_at)
            binary_loss = out.binary_loss if out.binary_loss is not None else zero
            mtp_loss = out.mtp_loss if out.mtp_loss is not None else zero
            sums.add_(torch.stack([lm_loss.detach().float(), out.aux_loss.detach().float(),
                                   binary_loss.detach().float(), mtp_loss.detach().float()]))
            objective = lm_loss + out.aux_loss + binary_loss + self.cfg.training.mtp_loss_weight * mtp_loss
            return ChunkOutput(None, objective / self.num_micro_batches)

        self.pipeline.run(self.pipeline.train_program, forward_step)
        moe = None
        for mb in sorted(stats):
            if stats[mb]:
                one = IterationMoEStats.of(stats[mb])  # after backward: Agg's times are in
                moe = one if moe is None else moe + one
        return sums, moe.on_host() if moe is not None else None  # every layer's device counts in one read

    def moe_metrics(self, moe: Optional[IterationMoEStats]) -> Record:
        """Per-MoE-layer load metrics of the iteration (same on every rank); keeps the per-source
        counts in `routed_per_source` for routing traces and the heatmap."""
        if self.state.pp_size > 1:  # every stage's layers, so that the reductions below see them all
            moe = IterationMoEStats.across_stages(moe, [layer.layer_index for layer in self.model.moe_layers()],
                                                  self.state.pp)
        if moe is None:
            return {"expert_load_imbalance": [], "moe_replicas": [], **{key: [] for key in TIMING_KEYS}}
        # each ep_esp group counted its own tokens; sum the groups
        loads = collectives.all_reduce(moe.tokens_per_ep_rank.to(self.device), self.state.edp)  # [L, ep]
        local = torch.cat([moe.tokens_per_expert, moe.dropped[:, None]], dim=1)[None]  # [1, L, E + 1]
        self.routed_per_source = collectives.all_gather(local.to(self.device), self.state.dp,
                                                        kind="moe_stats").cpu()  # [dp, L, E + 1]
        if self.cfg.logging.routing_trace:  # per micro-batch counts for the trace [dp, F, L, E]
            self.routed_per_forward = collectives.all_gather(moe.forward_counts[None].to(self.device), self.state.dp,
                                                             kind="moe_stats").cpu()
        total = self.routed_per_source.sum(0)  # [L, E + 1]
        # replicas per forward, averaged over this iteration's forwards and the ep_esp groups (edp)
        replicas = collectives.all_reduce(moe.replicas.double().to(self.device), self.state.edp)
        replicas = (replicas.cpu() / (moe.forwards * self.state.edp_size)).tolist()
        # per layer: this iteration's planner and replica-traffic times, the slowest rank's
        times = collectives.all_reduce(moe.timing_seconds().to(self.device), self.state.world,
                                       op="max").cpu() * 1e3  # [L, 5]
        return {"expert_load_imbalance": load_imbalance(loads), **layer_load_metrics(total[:, :-1], total[:, -1]),
                "moe_schedule": [dict(c) for c in moe.schedules], "moe_replicas": replicas,
                **{key: times[:, j].tolist() for j, key in enumerate(TIMING_KEYS)}}

    def vexpert_metrics(self, moe_layers, moves: List[int]) -> Record:
        """Per MoE layer (of every pipeline stage): vExpert primitives executed after this
        iteration's step; over the run and all layers: how many of each kind (FlexMoE's Expand /
        Shrink / Migrate)."""
        layers = [(layer.layer_index, n, getattr(layer.balancer, "ops_total", {}), layer.balancer.planned_slots.copy())
                  for layer, n in zip(moe_layers, moves)]
        if self.state.pp_size > 1:
            layers = sorted(row for rows in collectives.all_gather_object(layers, self.state.pp) for row in rows)
        totals: Dict[str, int] = {}
        for _, _, ops, _ in layers:
            for kind, n in ops.items():
                totals[kind] = totals.get(kind, 0) + n
        self.vexpert_slots = [(index, slots) for index, _, _, slots in layers]
        return {"vexpert_moves": [n for _, n, _, _ in layers], "vexpert_ops_total": totals}

    def memory_metrics(self) -> Record:
        """Memory, MB, {"rank<r>": MB} over the world: the parameters this rank holds (`param_mb`;
        vExperts: one copy per expert a rank holds, however many of its vExperts), the optimizer
        state (`optimizer_state_mb`: AdamW's moments, and fp32 masters in bf16 runs, sharded with
        `optimizer.distributed`), peak resident set size so far (`max_rss_mb`) and, on CUDA, the
        allocator's peak (`cuda_peak_mb`)."""
        peaks = [sum(p.numel() * p.element_size() for p in self.model.parameters()) / 2 ** 20,
                 optimizer_state_bytes(self.optimizer) / 2 ** 20,
                 resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024]  # Linux: KB
        if self.device.type == "cuda":
            peaks.append(torch.cuda.max_memory_allocated(self.device) / 2 ** 20)
        gathered = collectives.all_gather(torch.tensor([peaks], dtype=torch.float64, device=self.device),
                                          self.state.world, kind="stats").cpu()  # [world, 3 or 4]
        keys = ("param_mb", "optimizer_state_mb", "max_rss_mb", "cuda_peak_mb")[: gathered.shape[1]]
        return {key: {f"rank{r}": round(v, 1) for r, v in enumerate(gathered[:, j].tolist())}
                for j, key in enumerate(keys)}

    def train_step(self, iteration: int) -> Record:
        """One optimizer step on global batch `iteration - 1`; returns the iteration's metrics."""
        collectives.COMM_STATS.reset()
        step = timing.Stopwatch(self.device)  # wall time: synchronizes here (idle after the last step) and when read
        lr = self.learning_rate(iteration)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        self.grads.begin(self.num_micro_batches)  # overlap_grad_reduce: the last micro-batch's hooks start buckets
        self.timer.reset()
        sums, moe = self.forward_backward(iteration - 1)
        moe_layers = self.model.moe_layers()
        for layer in moe_layers:  # vExperts: the slots of an expert sum their gradients
            layer.balancer.before_grad_sync()
        update_expert_biases(moe_layers, self.state, self.cfg.moe.expert_bias_rate)  # moe.expert_bias
        self.grads.sync()
        grad_norm = self.grads.clip(self.cfg.optimizer.clip_grad)
        comm_bytes = collectives.COMM_STATS.bytes_by_kind()
        inter_node = collectives.COMM_STATS.inter_node_bytes_by_kind()  # all-to-all / p2p bytes across nodes
        # exposed / total per op kind, and of the token all-to-alls forward / backward: `Duration`s
        # read after the step's synchronize below (on CUDA nothing waits for the GPU before it)
        comm_times = collectives.COMM_STATS.seconds_by_kind(resolve=False)
        a2a = collectives.COMM_STATS.seconds_by_phase(A2A_KINDS, resolve=False)
        loss, aux_loss, binary_loss, mtp_loss = self.mean_over_dp(sums, self.num_micro_batches)
        if all_finite([loss, aux_loss, binary_loss, mtp_loss, grad_norm]):  # the same on every rank
            with self.timer("optimizer"):
                self.optimizer.step()
        elif self.cfg.training.on_nonfinite == "stop":
            raise NonFiniteError(f"iteration {iteration}: non-finite loss {loss} or grad norm {grad_norm}; "
                                 "stopping without applying it (training.on_nonfinite=stop)")
        else:
            self.skipped_iterations += 1
        # vExperts: FlexMoE / EPLB move slots (weights + AdamW moments) between iterations
        moves = [layer.balancer.after_optimizer_step(iteration, self.optimizer) for layer in moe_layers]
        vexperts = self.vexpert_metrics(moe_layers, moves) if self.uses_vexperts else {}
        after = collectives.COMM_STATS.bytes_by_kind()  # the moves and the all-gather ran after the snapshot above
        comm_bytes.update({k: v for k, v in after.items() if k in LATE_KINDS})
        after = collectives.COMM_STATS.inter_node_bytes_by_kind()  # the moves' part to other nodes
        inter_node.update({k: v for k, v in after.items() if k in LATE_KINDS})
        for key, seconds in collectives.COMM_STATS.seconds_by_kind(resolve=False).items():
            comm_times[key].update({k: v for k, v in seconds.items() if k in LATE_KINDS})
        self.latest_moe = moe  # for `step_details`
        seconds = step.seconds()
        comm_times, a2a = collectives.resolved(comm_times), collectives.resolved(a2a)
        tr = self.cfg.training
        return {
            "iteration": iteration, "loss": loss, "aux_loss": aux_loss, "lr": lr, "grad_norm": grad_norm,
            "tokens_per_sec": tr.global_batch_size * self.cfg.model.seq_length / seconds,
            "iter_time_ms": seconds * 1e3, "comm_bytes": comm_bytes, "comm_bytes_inter_node": inter_node,
            **vexperts,
            "time_ms": {**self.timer.ms(),
                        "comm_wait": sum(comm_times["exposed"].values()) * 1e3},
            "comm_exposed_ms": {k: v * 1e3 for k, v in comm_times["exposed"].items()},
            "comm_total_ms": {k: v * 1e3 for k, v in comm_times["total"].items()},
            "a2a_exposed_ms": {k: v * 1e3 for k, v in a2a["exposed"].items()},
            "a2a_total_ms": {k: v * 1e3 for k, v in a2a["total"].items()},
            "skipped_iterations": self.skipped_iterations,
            **({"binary_loss": binary_loss} if self.has_binary_head else {}),
            **({"mtp_loss": mtp_loss} if self.cfg.model.mtp_depth else {}),
        }

    def step_details(self) -> Record:
        """Collective: the latest `train_step`'s metrics that need other ranks' numbers (per-layer
        MoE loads, replicas and timings; memory per rank; the pipeline bubble). The loop asks only on
        iterations it logs (or traces / draws), so the other iterations run no metric collectives (issue #16)."""
        return {**self.moe_metrics(self.latest_moe), **self.memory_metrics(), **self.pipeline_metrics()}

    def pipeline_metrics(self) -> Record:
        """With pipeline stages: the latest iteration's bubble, 1 - compute / the slowest stage's
        schedule time, averaged over the ranks (`pipeline_bubble`), the ideal schedule's, and each
        rank's forward / backward compute ms in the schedule (`pipeline_compute_ms`)."""
        if self.state.pp_size == 1:
            return {}
        par = self.cfg.parallel
        wall = collectives.all_reduce(torch.tensor([self.pipeline.wall], device=self.device), self.state.pp, op="max")
        bubble = collectives.all_reduce(1.0 - self.pipeline.busy / wall.double(), self.state.world)
        compute = torch.tensor([[self.timer.ms().get(k, 0.0) for k in ("forward", "backward")]],
                               dtype=torch.float64, device=self.device)
        compute = collectives.all_gather(compute, self.state.world, kind="stats").cpu()  # [world, 2]
        return {"pipeline_bubble": float(bubble) / self.state.world_size,
                "pipeline_bubble_ideal": expected_bubble(par.pipeline, self.num_micro_batches, par.virtual_stages),
                "pipeline_compute_ms": {f"rank{r}": [round(v, 2) for v in row] for r, row in enumerate(compute.tolist())}}

    @torch.no_grad()
    def evaluate(self) -> Record:
        """Mean lm_loss and perplexity over `eval_iters` fixed global batches of held-out data (the
        LM loss only: multi-token prediction does not run in evaluation, model/mtp.py)."""
        self.model.eval()
        total = torch.zeros(1, device=self.device)
        for index in range(self.cfg.training.eval_iters):
            batches = self.micro_batches(self.valid_data, index)

            def forward_step(chunk: int, mb: int, hidden: Optional[torch.Tensor]) -> ChunkOutput:
                out = self.model(**batches[mb], chunk=chunk, hidden=hidden)
                if out.hidden is None:
                    total.add_(out.lm_loss.float())
                return ChunkOutput(out.hidden, None)

            self.pipeline.run(self.pipeline.eval_program, forward_step, training=False)
        self.model.train()
        (loss,) = self.mean_over_dp(total, self.cfg.training.eval_iters * self.num_micro_batches)
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}

    # -- the loop -------------------------------------------------------------------------------
    def train(self) -> List[Record]:
        """Run `training.train_iters` iterations; return the logged records (on every rank). Rank 0
        writes `<run_dir>/complete.json` when the last one is done (not after a stop signal;
        training/completion.py). `training.eval_only`: evaluate the loaded checkpoint instead
        (`evaluate_checkpoint`). A resume with nothing left to train says so and leaves the run
        directory as it is."""
        tr = self.cfg.training
        writer = self.state.rank == 0
        if tr.eval_only:
            return [self.evaluate_checkpoint()]
        start = self.load_checkpoint()  # before touching the run directory: a refused resume leaves it alone
        idle = self.nothing_to_train
        if idle is not None:
            if writer:
                print(idle, flush=True)
                if read_complete_marker(tr.run_dir) is None:
                    write_complete_marker(tr.run_dir, tr.train_iters)
            return []
        if writer:
            save_config(self.cfg, os.path.join(tr.run_dir, "config.yaml"))
            clear_complete_marker(tr.run_dir)  # training/completion.py: written again when this run finishes
        metrics = MetricsLogger(tr.run_dir, writer, self.cfg.logging.tensorboard, tr.train_iters, resume_from=start)
        metrics.print(f"{self.state.describe()} | {sum(p.numel() for p in self.model.parameters()):,} "
                      f"local parameters | {self.num_micro_batches} micro-batches per rank per iteration")
        records, elapsed, stopped = [], 0.0, False
        lm_eval = TRAINING_EVALS.get("evaluation.lm_eval_tasks")(self) if self.cfg.evaluation.lm_eval_tasks else None
        trace = self.routing_trace_writer() if writer and self.cfg.logging.routing_trace else None
        try:
            with StopRequest(self.state, self.device) as stop:
                for iteration in range(start + 1, tr.train_iters + 1):
                    record = self.train_step(iteration)
                    elapsed += record["iter_time_ms"] / 1e3
                    stopping = stop.agreed()  # preemption: every rank stops after the same iteration
                    evaluate = tr.eval_iters > 0 and tr.eval_interval > 0 and (
                        iteration % tr.eval_interval == 0 or iteration == tr.train_iters)
                    lm_eval_due = lm_eval is not None and lm_eval.due(iteration)
                    logged = (evaluate or lm_eval_due or stopping or iteration == 1 or iteration % tr.log_interval == 0
                              or iteration == tr.train_iters)
                    self.routed_per_source = None
                    if logged or self.cfg.logging.routing_trace or self.image_due(iteration):  # the same on every rank
                        record.update(self.step_details())
                        self.log_routing(iteration, trace, metrics)
                    if evaluate:
                        record.update(self.evaluate())
                    if lm_eval_due:  # collective; the training RNG and data untouched
                        record["lm_eval"] = lm_eval.run()
                    if logged:
                        metrics.log(record, eta_s=elapsed / (iteration - start) * (tr.train_iters - iteration))
                        records.append(record)
                    save_interval = self.cfg.checkpoint.save_interval
                    saved = None
                    if save_interval > 0 and (iteration % save_interval == 0 or iteration == tr.train_iters):
                        saved = self.save_checkpoint(iteration)
                    if stopping:
                        self.stop_early(iteration, stop.signal_name, saved, metrics)
                        stopped = True
                        break
        finally:
            metrics.close()
            if trace is not None:
                trace.close()
        for layer in self.model.moe_layers():  # best-effort vExpert moves of the last step land
            layer.balancer.complete_moves()
        if writer and not stopped:
            write_complete_marker(tr.run_dir, tr.train_iters)
        return records

    # -- checkpoints (training/checkpoint.py) -----------------------------------------------------
    def save_checkpoint(self, iteration: int) -> str:
        """Collective: save the training state after `iteration` under `checkpoint.dir`; return its path."""
        from megatron_moe.training import checkpoint

        return checkpoint.save_checkpoint(self.cfg, self.state, self.model, self.optimizer, iteration,
                                          {"skipped_iterations": self.skipped_iterations})

    def load_checkpoint(self) -> int:
        """Collective: load what `checkpoint.load` names (auto: this run's newest complete one, if
        any) once `check_resume` allows it (training/resume.py); return the iteration to continue
        after (0 = fresh start). Sets `nothing_to_train`: the line `train` prints instead (None: it trains)."""
        from megatron_moe.training import checkpoint

        path, iteration = checkpoint.load_path(self.cfg), 0
        if path is not None:
            notes = check_resume(self.cfg, path)  # every rank: the same files, the same verdict
            meta = checkpoint.load_checkpoint(path, self.cfg, self.state, self.model, self.optimizer)
            self.skipped_iterations = meta.get("trainer", {}).get("skipped_iterations", 0)
            self.loaded_from, iteration = path, meta["iteration"]
        self.nothing_to_train = nothing_to_train(self.cfg, path, iteration)
        if path is not None and self.state.rank == 0 and not self.nothing_to_train:  # else `train` says so
            print("\n".join([f"checkpoint: resumed from {path} (iteration {iteration})"] + notes), flush=True)
        return iteration

    def evaluate_checkpoint(self) -> Record:
        """`training.eval_only` (Megatron's --skip-train): `evaluate` the checkpoint `checkpoint.load`
        names, as training's evaluation after that iteration; rank 0 prints one line and appends
        the record to `<run_dir>/eval.jsonl`."""
        from megatron_moe.training.checkpoint import checkpoint_dir

        iteration = self.load_checkpoint()
        if self.loaded_from is None:
            raise CheckpointError(f"training.eval_only: no complete checkpoint under {checkpoint_dir(self.cfg)}")
        record = {"iteration": iteration, "checkpoint": self.loaded_from, **self.evaluate()}
        if self.state.rank == 0:
            print(f"eval-only: {self.loaded_from} (iteration {iteration}) | eval loss {record['eval_loss']:.4f} "
                  f"ppl {record['eval_ppl']:.2f} | {self.cfg.training.eval_iters} valid batches", flush=True)
            os.makedirs(self.cfg.training.run_dir, exist_ok=True)
            with open(os.path.join(self.cfg.training.run_dir, "eval.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")
        return record

    def stop_early(self, iteration: int, signal_name: Optional[str], saved: Optional[str],
                   metrics: MetricsLogger) -> None:
        """After a stop signal (training/failures.py): make sure a checkpoint of `iteration` exists
        (`saved`: the one the loop just wrote, if any); say so."""
        if saved is None:
            saved = self.save_checkpoint(iteration)
        outcome = f"checkpoint saved to {saved}"
        if self.state.rank == 0:
            requeue = request_requeue(saved, self.cfg.checkpoint.load, self.cfg.training.train_iters - iteration)
            outcome += f"; {requeue}" if requeue else ""
        metrics.print(f"{signal_name or 'a stop signal on another rank'}: stopped after iteration {iteration}; {outcome}")

    # -- routing traces and load pictures ------------------------------------------------------------
    def routing_trace_writer(self):
        from megatron_moe.moe.routing_trace import RoutingTraceWriter

        moe = self.cfg.moe
        layers = [i for i, flag in enumerate(moe_layer_flags(self.cfg)) if flag]  # MTP layers' after the model's
        return RoutingTraceWriter(os.path.join(self.cfg.training.run_dir, "routing"), {
            "num_moe_layers": len(layers), "moe_layer_indices": layers, "num_sources": self.state.dp_size,
            "num_experts": moe.num_experts, "top_k": moe.top_k,
            "tokens_per_iteration": self.cfg.training.global_batch_size * self.cfg.model.seq_length})

    def image_due(self, iteration: int) -> bool:
        """Is this an iteration whose load pictures go to TensorBoard (`logging.image_interval`)?"""
        interval = self.cfg.logging.image_interval
        return bool(self.cfg.logging.tensorboard and interval and iteration % interval == 0)

    def log_routing(self, iteration: int, trace, metrics: MetricsLogger) -> None:
        """Rank 0: the iteration's [source, expert] counts to the trace, and every
        `logging.image_interval` iterations the layer x expert heatmap to TensorBoard."""
        routed = self.routed_per_source  # [dp, L, E + 1]
        if routed is None or not metrics.enabled:
            return
        if trace is not None:
            trace.append(iteration, routed[..., :-1].transpose(0, 1).numpy(), routed[..., -1].T.numpy(),
                         self.routed_per_forward.permute(2, 0, 1, 3).numpy())  # [L, dp, F, E]
        if metrics.tensorboard and self.image_due(iteration):
            from megatron_moe.moe.load_plots import figure_rgb, heatmap_figure

            metrics.image("expert_load/heatmap", figure_rgb(heatmap_figure(routed[..., :-1].sum(0).numpy(), iteration)),
                          iteration)
            if self.vexpert_slots is not None:
                from megatron_moe.moe.load_plots import placement_figure

                for layer_index, slots in self.vexpert_slots:
                    metrics.image(f"vexperts/layer{layer_index}",
                                  figure_rgb(placement_figure(slots, layer_index, iteration)), iteration)
