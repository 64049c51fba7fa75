"""Runs this rank's pipeline program (training/pipeline_schedules.py) on the model: forwards and
backwards of (model chunk, micro-batch) pairs, with activations and their gradients sent point to
point between neighbouring stages (`collectives.p2p_exchange`, byte kind `pipeline`, asynchronous).

* An `Exchange` posts its sends and receives as one `batch_isend_irecv` and returns at once; a
  compute step waits only for the exchange that delivers what it needs (so sends and later
  receives overlap compute), and everything is waited for at the end. Within a batch, sends and receives are posted forward
  direction first, then backward, with their own tags: between two ranks the messages match in
  the same order on both sides (pipeline=2 interleaved sends both directions to one peer).
* Forward (chunk c, micro-batch j): the model's chunk on the received hidden states [b, s, h]
  (marked as requiring grad) or, for the first chunk, on the batch's tokens. It returns what to
  send on and the scalar this chunk back-propagates with gradient 1: (lm + aux + binary) / m on the
  last chunk, the chunk's MoE aux losses / m elsewhere, so every stage's aux losses enter the
  objective exactly once.
* Backward: autograd from the chunk's output (with the gradient received from the next stage) and
  its objective; the gradient of its input goes to the previous stage.
* Activations and their gradients travel in the parameters' dtype: bf16 with `training.precision=bf16`.

With one stage the 1F1B program is forward j, backward j for j = 0..m-1: the plain
gradient-accumulation loop. `busy` / `wall` of the last `run` give the bubble (the trainer
reduces them over the stages: 1 - busy / the slowest stage's wall time); both are spans of
`perf/timing.py` on the compute stream, read when asked for.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

from megatron_moe.config.schema import Config
from megatron_moe.distributed import collectives
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.precision import param_dtype
from megatron_moe.perf import timing
from megatron_moe.perf.timing import Duration
from megatron_moe.training.pipeline_schedules import PIPELINE_SCHEDULES, Exchange, Step, forward_only

KIND = "pipeline"  # byte-counter label of activations and their gradients between stages
FORWARD_TAG, BACKWARD_TAG = 0, 1


@dataclass
class ChunkOutput:
    hidden: Optional[torch.Tensor]  # [b, s, h] for the next stage (None on the model's last chunk)
    objective: Optional[torch.Tensor]  # scalar back-propagated with gradient 1 (None when not training)


ForwardStep = Callable[[int, int, Optional[torch.Tensor]], ChunkOutput]  # (chunk, micro-batch, hidden)


class PipelineRunner:
    def __init__(self, cfg: Config, state: ParallelState, device: torch.device, timer):
        par, tr, m = cfg.parallel, cfg.training, cfg.model
        self.state, self.device, self.timer = state, device, timer
        self.shape = (tr.micro_batch_size, m.seq_length, m.hidden_size)  # hidden states between stages
        self.dtype = param_dtype(tr.precision)  # bf16 runs send bf16 activations and gradients
        micro_batches = tr.global_batch_size // (tr.micro_batch_size * state.dp_size)
        stage = state.pp.rank
        self.train_program = PIPELINE_SCHEDULES.get(par.pipeline_schedule)(
            state.pp_size, stage, micro_batches, par.virtual_stages)
        self.eval_program = forward_only(state.pp_size, stage, micro_batches, par.virtual_stages)
        self._busy, self._wall = (Duration(), Duration()), Duration()

    @property
    def busy(self) -> float:
        """Seconds this rank computed (forward + backward phases) in the last `run`."""
        before, after = self._busy
        return float(after) - float(before)

    @property
    def wall(self) -> float:
        """Seconds the last `run` took, on this rank's compute stream."""
        return float(self._wall)

    def _exchange(self, step: Exchange, outputs, input_grads, inputs, output_grads, arrivals, training: bool):
        pp = self.state.pp
        nxt, prev = (pp.rank + 1) % pp.size, (pp.rank - 1) % pp.size
        sends, recvs, keys = [], [], []
        if step.send_forward is not None:
            out = outputs[step.send_forward] if training else outputs.pop(step.send_forward)
            hidden = out.hidden.detach()
            if hidden.shape != self.shape or hidden.dtype != self.dtype:
                raise RuntimeError(f"pipeline: a stage sends {tuple(hidden.shape)} {hidden.dtype}, the next expects "
                                   f"{self.shape} {self.dtype}")
            sends.append((nxt, hidden, FORWARD_TAG))
        if step.send_backward is not None:
            sends.append((prev, input_grads.pop(step.send_backward), BACKWARD_TAG))
        for key, store, peer, tag in ((step.recv_forward, inputs, prev, FORWARD_TAG),
                                      (step.recv_backward, output_grads, nxt, BACKWARD_TAG)):
            if key is not None:
                store[key] = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                recvs.append((peer, store[key], tag))
                keys.append((tag, key))
        pending = collectives.p2p_exchange(sends, recvs, pp, kind=KIND)
        for key in keys:
            arrivals[key] = pending
        return pending

    def run(self, program: List[Step], forward_step: ForwardStep, training: bool = True) -> None:
        """Execute `program` (this stage's steps); `forward_step` runs one chunk on one micro-batch."""
        clock, busy_before = timing.clock(self.device), self.timer.total()
        started = clock.mark()
        inputs: Dict = {}  # (chunk, mb) -> received hidden states (the chunk's input)
        outputs: Dict = {}  # (chunk, mb) -> ChunkOutput kept for the send and the backward
        output_grads: Dict = {}  # (chunk, mb) -> received gradient of the chunk's output
        input_grads: Dict = {}  # (chunk, mb) -> gradient of the chunk's input, to send back
        arrivals: Dict = {}  # (tag, (chunk, mb)) -> the Pending delivering it
        in_flight = []
        for step in program:
            if isinstance(step, Exchange):
                in_flight.append(self._exchange(step, outputs, input_grads, inputs, output_grads, arrivals, training))
                continue
            key = (step.chunk, step.micro_batch)
            if not step.backward:
                x = inputs.get(key) if training else inputs.pop(key, None)
                if x is not None:
                    arrivals.pop((FORWARD_TAG, key)).wait()
                    x.requires_grad_(training)
                with self.timer("forward"):
                    outputs[key] = forward_step(step.chunk, step.micro_batch, x)
                continue
            out = outputs.pop(key)
            pairs = [(out.objective, None)]
            if out.hidden is not None:
                arrivals.pop((BACKWARD_TAG, key)).wait()
                pairs.append((out.hidden, output_grads.pop(key)))
            pairs = [(t, g) for t, g in pairs if t is not None and t.requires_grad]
            with self.timer("backward"), collectives.backward_phase():
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
            x = inputs.pop(key, None)
            if x is not None:
                input_grads[key] = x.grad if x.grad is not None else torch.zeros_like(x)
        for pending in in_flight:
            pending.wait()
        self._wall = clock.span(started, clock.mark())
        self._busy = (busy_before, self.timer.total())
