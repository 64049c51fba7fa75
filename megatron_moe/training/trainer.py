"""The training loop: micro-batches with gradient accumulation, grad sync + clipping, AdamW,
warmup + cosine LR, periodic evaluation, metrics.

One iteration consumes one global batch. Data-parallel rank d runs the micro-batches j of it with
j % dp == d (`data/batches.py`) and back-propagates (lm_loss + aux_loss) / num_local_micro_batches
for each; `GradSync` then averages over replicas, so every layout computes the gradient of the same
global-batch mean loss. The reported loss is the mean of lm_loss over all the global batch's
micro-batches (all-reduced over dp): identical on every rank and every layout.

Precision: fp32, or bf16 autocast around the forward with fp32 master weights (parameters,
gradients and optimizer state stay fp32).
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from typing import List, Optional, Tuple

import torch

from megatron_moe.config import Config, save_config
from megatron_moe.data import GlobalBatchSampler, build_datasets, collate, rank_micro_batches
from megatron_moe.data.batches import Batch
from megatron_moe.distributed import collectives
from megatron_moe.distributed.launch import pick_backend
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.training.grads import GradSync
from megatron_moe.training.lr import LR_SCHEDULES
from megatron_moe.training.metrics import MetricsLogger, Record, load_imbalance
from megatron_moe.training.optimizer import build_optimizer


def training_device(cfg: Config) -> torch.device:
    if pick_backend(cfg.parallel.backend) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Trainer:
    def __init__(self, cfg: Config, state: ParallelState, model_cls: Optional[type] = None):
        if model_cls is None:
            from megatron_moe.model.gpt import GPTMoEModel as model_cls
        tr = cfg.training
        self.cfg, self.state = cfg, state
        self.device = training_device(cfg)
        torch.manual_seed(tr.seed + state.dp.rank)  # same stream on TP ranks, distinct per data replica
        self.model = model_cls(cfg, state).to(self.device)
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.lr_schedule = LR_SCHEDULES.get(cfg.optimizer.lr_schedule)
        self.grads = GradSync(list(self.model.named_parameters()), state)
        self.train_data, self.valid_data = build_datasets(cfg)
        self.train_batches = GlobalBatchSampler(len(self.train_data), tr.global_batch_size, tr.seed)
        self.valid_batches = GlobalBatchSampler(len(self.valid_data), tr.global_batch_size, tr.seed, shuffle=False)
        self.num_micro_batches = tr.global_batch_size // (tr.micro_batch_size * state.dp_size)  # per rank
        self.autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16)
                         if tr.precision == "bf16" else contextlib.nullcontext())

    # -- data ---------------------------------------------------------------------------------
    def micro_batches(self, dataset, sampler: GlobalBatchSampler, index: int) -> List[Batch]:
        """This rank's micro-batches of global batch `index`, on the training device."""
        tr = self.cfg.training
        parts = rank_micro_batches(sampler.batch(index), tr.micro_batch_size, self.state.dp_size, self.state.dp.rank)
        return [tuple(t.to(self.device) for t in collate(dataset, p)) for p in parts]

    def mean_over_dp(self, local_sums: torch.Tensor, count_per_rank: int) -> List[float]:
        """Per-rank sums over micro-batches -> means over all data-parallel micro-batches."""
        total = collectives.all_reduce(local_sums.detach().double().clone(), self.state.dp)
        return (total / (count_per_rank * self.state.dp_size)).tolist()

    # -- one iteration --------------------------------------------------------------------------
    def forward_backward(self, index: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Accumulate gradients of global batch `index` (0-based). Returns this rank's
        ([lm_loss sum, aux_loss sum] over its micro-batches, tokens per EP rank [moe layers, ep] or None)."""
        sums = torch.zeros(2, device=self.device)
        loads = None
        for tokens, labels, loss_mask in self.micro_batches(self.train_data, self.train_batches, index):
            with self.autocast:
                out = self.model(tokens, labels, loss_mask)
            ((out.lm_loss + out.aux_loss) / self.num_micro_batches).backward()
            sums += torch.stack([out.lm_loss.detach().float(), out.aux_loss.detach().float()])
            if out.moe_stats:
                counts = torch.stack([s.tokens_per_ep_rank.to(self.device) for s in out.moe_stats])  # [moe layers, ep]
                loads = counts if loads is None else loads + counts
        return sums, loads

    def train_step(self, iteration: int) -> Record:
        """One optimizer step on global batch `iteration - 1`; returns the iteration's metrics."""
        collectives.COMM_STATS.reset()
        start = time.perf_counter()
        lr = self.lr_schedule(self.cfg.optimizer, iteration, self.cfg.training.train_iters)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        sums, loads = self.forward_backward(iteration - 1)
        self.grads.sync()
        grad_norm = self.grads.clip(self.cfg.optimizer.clip_grad)
        self.optimizer.step()
        comm_bytes = collectives.COMM_STATS.bytes_by_kind()
        loss, aux_loss = self.mean_over_dp(sums, self.num_micro_batches)
        if loads is not None:  # each ep_esp group counted its own tokens; sum the groups
            collectives.all_reduce(loads, self.state.edp)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        tr = self.cfg.training
        return {
            "iteration": iteration, "loss": loss, "aux_loss": aux_loss, "lr": lr, "grad_norm": grad_norm,
            "tokens_per_sec": tr.global_batch_size * self.cfg.model.seq_length / seconds,
            "iter_time_ms": seconds * 1e3, "comm_bytes": comm_bytes,
            "expert_load_imbalance": load_imbalance(loads) if loads is not None else [],
        }

    @torch.no_grad()
    def evaluate(self) -> Record:
        """Mean lm_loss and perplexity over `eval_iters` fixed global batches of held-out data."""
        self.model.eval()
        total = torch.zeros(1, device=self.device)
        for index in range(self.cfg.training.eval_iters):
            for tokens, labels, loss_mask in self.micro_batches(self.valid_data, self.valid_batches, index):
                with self.autocast:
                    total += self.model(tokens, labels, loss_mask).lm_loss.float()
        self.model.train()
        (loss,) = self.mean_over_dp(total, self.cfg.training.eval_iters * self.num_micro_batches)
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}

    # -- the loop -------------------------------------------------------------------------------
    def train(self) -> List[Record]:
        """Run `training.train_iters` iterations; return the logged records (on every rank)."""
        tr = self.cfg.training
        writer = self.state.rank == 0
        if writer:
            save_config(self.cfg, os.path.join(tr.run_dir, "config.yaml"))
        metrics = MetricsLogger(tr.run_dir, writer, self.cfg.logging.tensorboard, tr.train_iters)
        metrics.print(f"{self.state.describe()} | {sum(p.numel() for p in self.model.parameters()):,} "
                      f"local parameters | {self.num_micro_batches} micro-batches per rank per iteration")
        records, elapsed = [], 0.0
        try:
            for iteration in range(1, tr.train_iters + 1):
                record = self.train_step(iteration)
                elapsed += record["iter_time_ms"] / 1e3
                evaluate = tr.eval_iters > 0 and tr.eval_interval > 0 and (
                    iteration % tr.eval_interval == 0 or iteration == tr.train_iters)
                if evaluate:
                    record.update(self.evaluate())
                if evaluate or iteration == 1 or iteration % tr.log_interval == 0 or iteration == tr.train_iters:
                    metrics.log(record, eta_s=elapsed / iteration * (tr.train_iters - iteration))
                    records.append(record)
        finally:
            metrics.close()
        return records
