"""Pipeline stages in the simulator (`parallel.pipeline` > 1; docs/pipeline.md, docs/simulator.md).

The stages run the training code's own programs (`training/pipeline_schedules.programs`: Megatron's
1F1B or interleaved 1F1B for `parallel.pipeline_schedule`, `virtual_stages`), timed by its own
`simulate`:

* a compute step (forward or backward of one micro-batch through one model chunk) lasts what the
  stage's slowest rank takes through the chunk's ops (`sim/runner.py`: its sublayers, their MoE
  layers with their schedules, balancers and overlaps, the embedding on the model's first chunk,
  the output layer and loss on its last), each step on its own timeline with the stage's ranks
  starting together;
* a message (activations [b, s, h] forward, their gradient backward, bf16 or fp32) goes from stage s's
  rank r to the next (previous) stage's rank r, `world / p` ranks away: point to point on the
  `p2p` link inside or across nodes, the slowest rank's pair, from when both sides posted it
  (`simulate`'s `message_time`); a stage's exchange batches complete in order. Bytes: kind
  "pipeline/pp", every send of the programs, and its part to other nodes;
* `pipeline_bubble`, as the trainer's metric: per stage 1 - its compute time / the slowest stage's
  program time, averaged (equal stages, free messages: (p - 1) / (v m + p - 1)).

After the programs every stage's ranks start the iteration's end (`sim/params.py`) when their own
program ends; the collectives across stages (the tied embedding's gradient sum over `embedding`,
first and last stage; the grad norm's and the losses' sums over `pp`: ops on those groups, costed
like any collective from `WorldLayout`'s sizes and node spans) start when the rank's peers in every
member stage are ready (`run_stages`).
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import numpy as np

from megatron_moe.sim.cluster import Cluster
from megatron_moe.sim.ops import Op, Traffic, Widths, profile_elements
from megatron_moe.sim.timeline import Timeline
from megatron_moe.training.pipeline import KIND as PIPELINE_KIND
from megatron_moe.training.pipeline_schedules import Compute, Exchange, Simulation, programs, simulate

CROSS_STAGE_GROUPS = ("pp", "embedding")
StepKey = Tuple[int, bool, int, int]  # (stage, backward, virtual chunk, micro-batch)


class Pipeline:
    """One layout's stages: their programs, message costs and bytes, and the end across stages."""

    def __init__(self, cfg, layout, cluster: Cluster, micro_batches: int, widths: Widths = Widths()):
        par, m = cfg.parallel, cfg.model
        self.layout, self.cluster = layout, cluster
        self.p, self.v, self.micro_batches = par.pipeline, par.virtual_stages, micro_batches
        self.programs = programs(par.pipeline_schedule, self.p, micro_batches, self.v)
        self.elements = cfg.training.micro_batch_size * m.seq_length * m.hidden_size  # one message
        self.element_bytes = widths.activation
        local = np.arange(layout.stage_size)
        self.nodes = np.stack([layout.node_of(s * layout.stage_size + local) for s in range(self.p)])  # [p, S]
        neighbours = [(s, t) for s in range(self.p) for t in ((s + 1) % self.p, (s - 1) % self.p) if t != s]
        self.message = {pair: float(self._p2p(*pair).max()) for pair in neighbours}  # seconds of one message

    def _p2p(self, sender: int, receiver: int) -> np.ndarray:
        """[S] seconds of one message from each rank of `sender` to its peer in `receiver`."""
        off = self.nodes[sender] != self.nodes[receiver]
        x = profile_elements(self.elements, self.element_bytes)
        return self.cluster.exchange("p2p", np.where(off, 0.0, x), np.where(off, x, 0.0))

    def chunks(self) -> List[Tuple[int, int]]:
        """(stage, virtual chunk) of every model chunk, in model order."""
        return [(k % self.p, k // self.p) for k in range(self.p * self.v)]

    def run(self, step_seconds: Dict[StepKey, float]) -> Simulation:
        """The programs with these compute-step times and the messages' costs."""
        def step_time(s: int, step: Compute) -> float:
            return step_seconds[(s, step.backward, step.chunk, step.micro_batch)]

        return simulate(self.programs, self.v, step_time=step_time,
                        message_time=lambda sender, receiver: self.message[(sender, receiver)])

    def traffic(self, stage: int) -> Traffic:
        """Stage `stage`'s point-to-point bytes per rank in one iteration (every send of its program)."""
        counted, inter = np.zeros(self.layout.stage_size), np.zeros(self.layout.stage_size)
        for step in self.programs[stage]:
            if not isinstance(step, Exchange):
                continue
            for key, peer in ((step.send_forward, (stage + 1) % self.p), (step.send_backward, (stage - 1) % self.p)):
                if key is not None:
                    counted += self.element_bytes * self.elements
                    inter += np.where(self.nodes[stage] != self.nodes[peer], self.element_bytes * self.elements, 0.0)
        return Traffic(f"{PIPELINE_KIND}/pp", counted, inter)

    # -- collectives across stages ------------------------------------------------------------------
    def members(self, group: str) -> List[int]:
        return list(range(self.p)) if group == "pp" else [0, self.p - 1]

    def run_stages(self, timelines: Sequence[Timeline], ops: Sequence[List[Op]], label: str) -> None:
        """Every stage's `ops` on its timeline, in order; a collective over a group across stages
        (`CROSS_STAGE_GROUPS`) waits for the rank's peers in its member stages to reach it (they list
        those collectives in the same order), then runs for the slowest member's seconds."""
        pos = [0] * len(timelines)
        while True:
            waiting = {}
            for s, timeline in enumerate(timelines):
                while pos[s] < len(ops[s]) and ops[s][pos[s]].group not in CROSS_STAGE_GROUPS:
                    timeline.run([ops[s][pos[s]]], label)
                    pos[s] += 1
                if pos[s] < len(ops[s]):
                    waiting[s] = ops[s][pos[s]]
            if not waiting:
                return
            op = waiting[min(waiting)]
            members = self.members(op.group)
            assert all(s in waiting and (waiting[s].name, waiting[s].group) == (op.name, op.group)
                       for s in members), f"stages {members} disagree on the collective {op.name} over {op.group}"
            start = np.max([timelines[s].clock for s in members], axis=0)  # [S]: local rank r's peers
            seconds = np.max([waiting[s].seconds() for s in members], axis=0)
            for s in members:
                timelines[s].join(label, op.name, start, seconds)
                pos[s] += 1
