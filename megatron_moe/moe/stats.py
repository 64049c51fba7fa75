"""Per-layer MoE statistics, refreshed by every `MoELayer.forward` (`layer.last_stats`).

What the router counted stays on the device (`tokens_per_expert`, `dropped`): a forward reads
nothing for its statistics. `IterationMoEStats` sums them over an iteration's micro-batches on
the device and `on_host()` reads every layer's at once, one host read per iteration
(`perf/host_sync.py`; the trainer calls it after the iteration's backward passes). What the
placement counted (`tokens_per_ep_rank`) was computed on the host from the counts it read."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional

import torch

from megatron_moe.perf.host_sync import to_host_all
from megatron_moe.perf.timing import Duration


@dataclass
class MoEStats:
    # Long[E] on the device: routed (token, expert) assignments of this rank's data-parallel
    # micro-batch, before drops
    tokens_per_expert: torch.Tensor
    # Long scalar on the device (or an int): assignments of that micro-batch dropped by capacity (0 when dropless)
    dropped: torch.Tensor
    # Long[ep]: assignments actually computed by (each ESP shard of) every EP rank of this rank's
    # `ep_esp` group in this forward, after drops and placement; redundant copies included (the
    # baseline computes each TP rank's copy of a token)
    tokens_per_ep_rank: torch.Tensor
    # the schedule that ran this forward (`moe.schedule`; with `auto`, the one Parm's Alg. 1 picked)
    schedule: str = ""
    # expert replicas beyond the owners in this forward's placement (`Placement.num_replicas`)
    replicas: int = 0
    # seconds the balancer spent planning in this forward (Pro-Prophet's `Plan`)
    plan_seconds: float = 0.0
    # {"trans" | "agg": [exposed, total] `Duration`s} of this layer's replica traffic; Agg's
    # entries are filled in by the backward pass (read it after backward)
    replica_times: Optional[Dict[str, List[Duration]]] = None

    def timing(self) -> List[Duration]:
        """[plan, trans exposed, trans total, agg exposed, agg total] seconds (`perf/timing.py`
        `Duration`s: on CUDA read when the metrics are, not here)."""
        times = self.replica_times or {}
        trans, agg = times.get("trans", [Duration()] * 2), times.get("agg", [Duration()] * 2)
        return [Duration(self.plan_seconds), trans[0], trans[1], agg[0], agg[1]]

    @classmethod
    def merge(cls, parts: List["MoEStats"]) -> "MoEStats":
        """One micro-batch's stats from those of its batch parts (Lancet's partitioned forward):
        counts summed, the schedules that ran joined ("s1+s2" when `auto` picked both), the most
        replicas of any part, planning time summed; the parts share the layer's replica times."""
        schedules = sorted({p.schedule for p in parts})
        return cls(sum(p.tokens_per_expert for p in parts), sum(p.dropped for p in parts),
                   sum(p.tokens_per_ep_rank for p in parts), "+".join(schedules), max(p.replicas for p in parts),
                   sum(p.plan_seconds for p in parts), parts[-1].replica_times)

    @property
    def load_imbalance(self) -> float:
        """max / mean of `tokens_per_ep_rank` (1.0 = perfectly balanced or no tokens)."""
        load = self.tokens_per_ep_rank.double()
        mean = float(load.mean())
        return float(load.max()) / mean if mean > 0 else 1.0


@dataclass
class IterationMoEStats:
    """Every MoE layer's `MoEStats` summed over this rank's micro-batches of one iteration."""

    # Long[L, E] routed assignments before drops, Long[L] assignments dropped by capacity: on the
    # device until `on_host()`
    tokens_per_expert: torch.Tensor
    dropped: torch.Tensor
    tokens_per_ep_rank: torch.Tensor  # Long[L, ep] assignments computed per EP rank (host)
    # per layer: how many of this rank's micro-batch forwards ran each schedule (Parm `auto` may
    # pick s1 or s2 per layer and forward)
    schedules: List[Counter] = field(default_factory=list)
    replicas: torch.Tensor = None  # Long[L] expert replicas beyond the owners, summed over forwards
    forwards: int = 1  # micro-batch forwards summed
    # [L][5] `Duration`s summed over forwards: plan, trans exposed / total, agg exposed / total
    # (`timing_seconds()` reads them)
    timing: List[List[Duration]] = None
    # Long[F, L, E] `tokens_per_expert` of each forward, in order (routing traces keep them per
    # micro-batch); on the device until `on_host()`
    forward_counts: torch.Tensor = None

    @classmethod
    def of(cls, stats: List[MoEStats]) -> "IterationMoEStats":
        """One micro-batch's stats (`ModelOutput.moe_stats`, one per MoE layer); the router's
        counts stay where they are (no host read)."""
        counts = torch.stack([s.tokens_per_expert for s in stats])  # [L, E]
        dropped = torch.stack([torch.as_tensor(s.dropped, dtype=torch.long, device=counts.device) for s in stats])
        return cls(counts, dropped, torch.stack([s.tokens_per_ep_rank for s in stats]),
                   [Counter({s.schedule: 1}) for s in stats], torch.tensor([s.replicas for s in stats]),
                   timing=[s.timing() for s in stats], forward_counts=counts[None])

    def on_host(self) -> "IterationMoEStats":
        """The same statistics with the device counts read to the host: every layer's and every
        forward's in one read (`perf/host_sync.py`)."""
        counts, dropped, forward = to_host_all([self.tokens_per_expert.long(), self.dropped.long(),
                                                self.forward_counts.long()], "iteration statistics")
        return replace(self, tokens_per_expert=counts, dropped=dropped, forward_counts=forward)

    def timing_seconds(self) -> torch.Tensor:
        """Double[L, 5] seconds of `timing` (waits for the device where a span has not ended)."""
        return torch.tensor([[float(d) for d in row] for row in self.timing], dtype=torch.float64)

    @classmethod
    def across_stages(cls, stats: Optional["IterationMoEStats"], layers: List[int],
                      group) -> Optional["IterationMoEStats"]:
        """Every pipeline stage's MoE layers in layer order, on every rank of the ``pp`` `group`
        (`stats`: this stage's, or None without MoE layers; `layers`: their global indices)."""
        from megatron_moe.distributed import collectives

        parts = [part for part in collectives.all_gather_object((list(layers), stats), group) if part[1] is not None]
        if not parts:
            return None
        rows = sorted((index, stage, row) for stage, (indices, _) in enumerate(parts)
                      for row, index in enumerate(indices))

        def pick(name: str) -> torch.Tensor:
            return torch.cat([getattr(parts[stage][1], name)[row: row + 1] for _, stage, row in rows])

        return cls(pick("tokens_per_expert"), pick("dropped"), pick("tokens_per_ep_rank"),
                   [parts[stage][1].schedules[row] for _, stage, row in rows], pick("replicas"), parts[0][1].forwards,
                   [parts[stage][1].timing[row] for _, stage, row in rows],
                   torch.cat([parts[stage][1].forward_counts[:, row: row + 1] for _, stage, row in rows], dim=1))

    def __add__(self, other: "IterationMoEStats") -> "IterationMoEStats":
        return IterationMoEStats(self.tokens_per_expert + other.tokens_per_expert, self.dropped + other.dropped,
                                 self.tokens_per_ep_rank + other.tokens_per_ep_rank,
                                 [a + b for a, b in zip(self.schedules, other.schedules)],
                                 self.replicas + other.replicas, self.forwards + other.forwards,
                                 [[a + b for a, b in zip(x, y)] for x, y in zip(self.timing, other.timing)],
                                 torch.cat([self.forward_counts, other.forward_counts]))
