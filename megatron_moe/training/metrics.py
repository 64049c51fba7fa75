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

`scalars` flattens any nesting: dicts by key, a list that is the field itself by MoE layer
(``<field>/layer<i>``), a list inside a field by `LIST_ITEM_NAMES` or by index
(``pipeline_compute_ms/rank<r>/forward``, ``moe_schedule/layer<i>/<schedule>``), tensors and
numpy arrays as the numbers or lists they hold. An entry that is no real number (None, a string,
another object) is left out of TensorBoard, and the logger says so once per field; metrics.jsonl
keeps the whole record (tensors as lists).
"""
from __future__ import annotations

import contextlib
import datetime
import json
import numbers
import os
from typing import Any, Dict, Iterator, Optional, Set, Tuple

import numpy as np
import torch

from megatron_moe.perf import timing
from megatron_moe.perf.timing import Duration

Record = Dict[str, Any]


def format_console(record: Record, train_iters: int, eta_s: float) -> str:
    line = (f"iter {record['iteration']:>6}/{train_iters} | loss {record['loss']:.4f} | "
            f"aux {record['aux_loss']:.4f} | lr {record['lr']:.3e} | grad norm {record['grad_norm']:.3f} | "
            f"{record['tokens_per_sec']:,.0f} tok/s | {record['iter_time_ms']:.1f} ms/iter | "
            f"ETA {datetime.timedelta(seconds=round(eta_s))}")
    if "binary_loss" in record:
        line += f" | binary loss {record['binary_loss']:.4f}"
    if "mtp_loss" in record:  # multi-token prediction (model/mtp.py); TensorBoard `mtp_loss`
        line += f" | mtp loss {record['mtp_loss']:.4f}"
    if record.get("skipped_iterations"):
        line += f" | skipped {record['skipped_iterations']} non-finite"
    if "eval_loss" in record:
        line += f" | eval loss {record['eval_loss']:.4f} ppl {record['eval_ppl']:.2f}"
    for task, values in record.get("lm_eval", {}).items():  # evaluation.lm_eval_tasks (evaluation/during_training.py)
        line += f" | {task} " + " ".join(f"{k} {v:.3f}" for k, v in values.items())
    return line


# names of the items of a list nested in a field (default: the item's index; a list that is the
# field itself is per MoE layer: `layer<i>`)
LIST_ITEM_NAMES = {"pipeline_compute_ms": ("forward", "backward")}


def scalars(record: Record, skipped: Optional[Dict[str, str]] = None) -> Iterator[Tuple[str, float]]:
    """(tag, value) pairs for TensorBoard: nested dicts, lists and tensors of any depth flattened
    (see the module docstring). Entries that are no real number (None, strings, other objects)
    are left out; `skipped` (if given) receives {tag: reason} for each."""
    for key, value in record.items():
        if key != "iteration":
            yield from _flatten(str(key), value, str(key), skipped)


def _flatten(tag: str, value: Any, field: str, skipped: Optional[Dict[str, str]]) -> Iterator[Tuple[str, float]]:
    if isinstance(value, (torch.Tensor, np.ndarray, np.generic)):
        value = value.tolist()  # 0-d: a number (complex ones are skipped below); else nested lists
    if isinstance(value, numbers.Real):  # bool, int, float, numpy reals
        yield tag, float(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _flatten(f"{tag}/{k}", v, field, skipped)
    elif isinstance(value, (list, tuple)):
        names = LIST_ITEM_NAMES.get(field, ())
        for i, v in enumerate(value):
            name = f"layer{i}" if tag == field else names[i] if len(value) == len(names) else str(i)
            yield from _flatten(f"{tag}/{name}", v, field, skipped)
    elif skipped is not None:
        skipped[tag] = "no value (None)" if value is None else f"{type(value).__name__} {value!r:.40}, not a number"


def _jsonable(value: Any) -> Any:
    """`json.dumps` fallback: tensors and numpy values as numbers / lists, anything else as its str."""
    if isinstance(value, (torch.Tensor, np.ndarray, np.generic)):
        return value.tolist()
    return str(value)


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
        self._reported: Set[str] = set()  # fields with entries left out of TensorBoard, reported once
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
        self._jsonl.write(json.dumps(record, default=_jsonable) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            skipped: Dict[str, str] = {}
            for tag, value in scalars(record, skipped):
                self._tb.add_scalar(tag, value, record["iteration"])
            for tag, reason in skipped.items():  # once per field, not every iteration
                field = tag.split("/")[0]
                if field not in self._reported:
                    self._reported.add(field)
                    self.print(f"tensorboard: {tag} not written ({reason}); metrics.jsonl has it "
                               f"(reported once per field)")

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
    """Seconds per named phase (`with timer("forward"): ...`), summed until `reset()`: spans of
    `perf/timing.py` on the training device (CUDA: events on the compute stream, read when the
    metrics are, so timing a phase never waits for the GPU). `seconds` holds `Duration`s."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: Dict[str, Duration] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        with timing.span(self.device) as span:
            yield
        self.seconds[phase] = self.seconds.get(phase, Duration()) + span.duration

    def total(self) -> Duration:
        return sum(self.seconds.values(), Duration())

    def ms(self) -> Dict[str, float]:
        """{phase: ms} (reads the spans)."""
        return {phase: float(d) * 1e3 for phase, d in self.seconds.items()}

    def reset(self) -> None:
        self.seconds = {}
