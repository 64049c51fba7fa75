"""Training metrics out: one console line, one `metrics.jsonl` object and TensorBoard scalars per
logged iteration. Only the writing rank (rank 0) creates files; the others keep a disabled logger.

A record is a flat dict of numbers plus two nested fields: ``comm_bytes`` ({op kind: bytes}) and
``expert_load_imbalance`` ([one max/mean ratio per MoE layer]); TensorBoard gets those as
``comm_bytes/<kind>`` and ``expert_load_imbalance/layer<i>``.
"""
from __future__ import annotations

import datetime
import json
import os
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

Record = Dict[str, Any]


def format_console(record: Record, train_iters: int, eta_s: float) -> str:
    line = (f"iter {record['iteration']:>6}/{train_iters} | loss {record['loss']:.4f} | "
            f"aux {record['aux_loss']:.4f} | lr {record['lr']:.3e} | grad norm {record['grad_norm']:.3f} | "
            f"{record['tokens_per_sec']:,.0f} tok/s | {record['iter_time_ms']:.1f} ms/iter | "
            f"ETA {datetime.timedelta(seconds=round(eta_s))}")
    if "eval_loss" in record:
        line += f" | eval loss {record['eval_loss']:.4f} ppl {record['eval_ppl']:.2f}"
    return line


def scalars(record: Record) -> Iterator[Tuple[str, float]]:
    """(tag, value) pairs for TensorBoard, nested fields flattened."""
    for key, value in record.items():
        if key == "iteration":
            continue
        if isinstance(value, dict):
            yield from ((f"{key}/{k}", float(v)) for k, v in value.items())
        elif isinstance(value, list):
            yield from ((f"{key}/layer{i}", float(v)) for i, v in enumerate(value))
        else:
            yield key, float(value)


class MetricsLogger:
    def __init__(self, run_dir: str, enabled: bool, tensorboard: bool, train_iters: int):
        self.enabled = enabled
        self.train_iters = train_iters
        self._jsonl = None
        self._tb: Optional[Any] = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self._jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "w")
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
