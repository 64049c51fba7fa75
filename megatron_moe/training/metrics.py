"""Training metrics out: one console line, one `metrics.jsonl` object and TensorBoard scalars per
logged iteration. Only the writing rank (rank 0) creates files; the others keep a disabled logger.

A record is a flat dict of numbers plus nested fields: dicts ``comm_bytes`` ({op kind: bytes} of
the forward, backward and gradient sync; the metric collectives after them are not included),
``comm_bytes_inter_node`` (the all-to-all and point-to-point part of it sent to other nodes,
`parallel.ranks_per_node`),
``comm_exposed_ms`` / ``comm_total_ms`` ({op kind: ms} of the same ops: time the step was blocked
by them / their whole span; they differ where communication overlaps other work, e.g. SAA) and
``time_ms`` ({forward, backward, optimizer, comm_wait = all exposed communication}), and per-MoE-layer lists
``expert_load_imbalance`` (FlexMoE Eq. 6 balance ratio: max/mean over EP ranks),
``balance_degree`` (Pro-Prophet: std of the per-expert load), ``dropped_fraction``,
``moe_replicas`` (expert replicas beyond the owners per forward), ``plan_ms`` (the balancer's
planning time) and ``trans_exposed_ms`` / ``trans_total_ms`` / ``agg_exposed_ms`` /
``agg_total_ms`` (the layer's replica weight and gradient traffic; slowest rank);
TensorBoard gets those as ``<field>/<key>`` and ``<field>/layer<i>``.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import time
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

Record = Dict[str, Any]


def format_console(record: Record, train_iters: int, eta_s: float) -> str:
    line = (f"iter {record['iteration']:>6}/{train_iters} | loss {record['loss']:.4f} | "
            f"aux {record['aux_loss']:.4f} | lr {record['lr']:.3e} | grad norm {record['grad_norm']:.3f} | "
            f"{record['tokens_per_sec']:,.0f} tok/s | {record['iter_time_ms']:.1f} ms/iter | "
            f"ETA {datetime.timedelta(seconds=round(eta_s))}")
    if "binary_loss" in record:
        line += f" | binary loss {record['binary_loss']:.4f}"
    if record.get("skipped_iterations"):
        line += f" | skipped {record['skipped_iterations']} non-finite"
    if "eval_loss" in record:
        line += f" | eval loss {record['eval_loss']:.4f} ppl {record['eval_ppl']:.2f}"
    return line


def scalars(record: Record) -> Iterator[Tuple[str, float]]:
    """(tag, value) pairs for TensorBoard, nested fields flattened."""
    for key, value in record.items():
        if key == "iteration":
            continue
        if isinstance(value, dict):
            for k, v in value.items():
                if isinstance(v, list):  # e.g. pipeline_compute_ms: {rank: [forward ms, backward ms]}
                    yield from ((f"{key}/{k}/{i}", float(n)) for i, n in enumerate(v))
                else:
                    yield f"{key}/{k}", float(v)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                if isinstance(v, dict):  # e.g. moe_schedule: {schedule name: forwards} per layer
                    yield from ((f"{key}/layer{i}/{k}", float(n)) for k, n in v.items())
                else:
                    yield f"{key}/layer{i}", float(v)
        else:
            yield key, float(value)


def open_jsonl(path: str, resume_from: int):
    """A fresh run starts a new file. A run resumed from a checkpoint of iteration k keeps the
    records of iterations <= k (a preempted run may have logged past its last checkpoint) and
    appends after them."""
    kept = []
    if resume_from > 0 and os.path.exists(path):
        with open(path) as f:
            kept = [line for line in f if line.strip() and json.loads(line).get("iteration", 0) <= resume_from]
    out = open(path, "w")
    out.writelines(kept)
    return out


class MetricsLogger:
    def __init__(self, run_dir: str, enabled: bool, tensorboard: bool, train_iters: int, resume_from: int = 0):
        self.enabled = enabled
        self.train_iters = train_iters
        self._jsonl = None
        self._tb: Optional[Any] = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self._jsonl = open_jsonl(os.path.join(run_dir, "metrics.jsonl"), resume_from)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))

    def print(self, message: str) -> None:
        if self.enabled:
            print(message, flush=True)

    def log(self, record: Record, eta_s: float) -> None:
        if not self.enabled:
            return
        self.print(format_console(record, self.train_iters, eta_s))
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for tag, value in scalars(record):
                self._tb.add_scalar(tag, value, record["iteration"])

    @property
    def tensorboard(self) -> bool:
        return self._tb is not None

    def image(self, tag: str, rgb, iteration: int) -> None:
        """An image (uint8 numpy [H, W, 3]) to TensorBoard."""
        if self._tb is not None:
            self._tb.add_image(tag, rgb, iteration, dataformats="HWC")

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def load_imbalance(tokens_per_ep_rank: torch.Tensor) -> list:
    """[layers, ep] token counts -> max/mean per layer (1.0 = perfectly balanced)."""
    counts = tokens_per_ep_rank.double()
    mean = counts.mean(dim=1).clamp(min=1e-12)
    return (counts.max(dim=1).values / mean).tolist()


def layer_load_metrics(tokens_per_expert: torch.Tensor, dropped: torch.Tensor) -> Record:
    """Global [L, E] assignments per expert and [L] drops -> per-layer lists: `balance_degree`
    (Pro-Prophet §VI: standard deviation of the per-expert load) and `dropped_fraction`."""
    counts = tokens_per_expert.double()
    total = counts.sum(dim=1).clamp(min=1)
    return {"balance_degree": counts.std(dim=1, unbiased=False).tolist(),
            "dropped_fraction": (dropped.double() / total).tolist()}


class PhaseTimer:
    """Wall seconds per named phase (`with timer("forward"): ...`), summed until `reset()`.
    On CUDA each phase ends with a synchronize so that the time is the phase's own."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds: Dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def reset(self) -> None:
        self.seconds = {}
