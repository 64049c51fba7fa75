"""Pipeline schedules as per-rank programs: Megatron-LM's 1F1B and interleaved 1F1B (Narayanan et
al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC'21,
§2.2.1 / §2.2.2; the step order of Megatron-LM's `forward_backward_pipelining_without_interleaving`
and `..._with_interleaving`), `parallel.pipeline_schedule`. Each `Exchange` is posted asynchronously
and waited for only by the compute step that needs what it receives (training/pipeline.py), so
sends and later receives run while the stage computes.

A program is what one pipeline stage does, in order: `Compute` steps (the forward or the backward of
one micro-batch through one of its model chunks) and `Exchange` steps (one batch of point-to-point
sends and receives, posted together as `batch_isend_irecv`). Model chunk k = virtual * p + stage
(p stages, v virtual stages each): stage s holds chunks s, p + s, ..., so activations travel
0 -> 1 -> ... -> p-1 -> 0 (the next virtual chunk) -> ... and gradients the other way.

* `1f1b`: p - s - 1 warm-up forwards, then one forward + one backward per step, then the
  remaining backwards. Bubble: (p - 1) / (m + p - 1) of the time, m micro-batches per stage.
* `interleaved` (v >= 2): (p - s - 1) * 2 + (v - 1) * p warm-up forwards over the chunks in groups
  of p micro-batches; bubble (p - 1) / (v m + p - 1): v times smaller for v times the messages.
  Needs m divisible by p (Megatron's rule).

Programs are pure data: `simulate` runs every stage's program against the others' (unit compute
times, or any per-step times and message costs: the cluster simulator's, sim/stages.py), checks
that every message is sent after it is computed, received by the step that expects exactly that
(chunk, micro-batch) in the same order on both sides (NCCL matches point-to-point messages by order,
not by tag) and that a stage's exchange batches, completed in order as on one
NCCL stream, never deadlock; and returns each stage's idle fraction (the bubble).
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from megatron_moe.config.registry import Registry
from megatron_moe.config.errors import ConfigError
from megatron_moe.config.validate import micro_batches as config_micro_batches, section_check

PIPELINE_SCHEDULES = Registry("parallel.pipeline_schedule")

Key = Tuple[int, int]  # (virtual chunk on this stage, micro-batch)


@dataclass(frozen=True)
class Compute:
    backward: bool
    chunk: int  # virtual chunk index on this stage (model chunk = chunk * p + stage)
    micro_batch: int


@dataclass(frozen=True)
class Exchange:
    """One batch of point-to-point operations (each entry a (chunk, micro-batch) of this stage)."""

    send_forward: Optional[Key] = None  # the chunk's output -> the next stage
    recv_forward: Optional[Key] = None  # the chunk's input <- the previous stage
    send_backward: Optional[Key] = None  # the gradient of the chunk's input -> the previous stage
    recv_backward: Optional[Key] = None  # the gradient of the chunk's output <- the next stage

    def __bool__(self) -> bool:
        return any((self.send_forward, self.recv_forward, self.send_backward, self.recv_backward))


Step = Union[Compute, Exchange]


class _Builder:
    """Appends steps; tracks which micro-batch each chunk receives next (chunks receive in order)."""

    def __init__(self, stages: int, stage: int, virtual: int):
        self.p, self.s, self.v = stages, stage, virtual
        self.steps: List[Step] = []
        self.next_input = [0] * virtual
        self.next_grad = [0] * virtual

    def is_first(self, chunk: int) -> bool:  # the model's first chunk: its input is the embedding's
        return self.s == 0 and chunk == 0

    def is_last(self, chunk: int) -> bool:  # the model's last chunk: its output is the loss
        return self.s == self.p - 1 and chunk == self.v - 1

    def compute(self, backward: bool, chunk: int, micro_batch: int) -> None:
        self.steps.append(Compute(backward, chunk, micro_batch))

    def input_of(self, chunk: int) -> Key:
        self.next_input[chunk] += 1
        return chunk, self.next_input[chunk] - 1

    def grad_of(self, chunk: int) -> Key:
        self.next_grad[chunk] += 1
        return chunk, self.next_grad[chunk] - 1

    def exchange(self, send_forward: Optional[Key] = None, recv_forward: Optional[int] = None,
                 send_backward: Optional[Key] = None, recv_backward: Optional[int] = None) -> None:
        """recv_forward / recv_backward: the chunk that receives (its next micro-batch in order)."""
        if send_forward is not None and self.is_last(send_forward[0]):
            send_forward = None
        if send_backward is not None and self.is_first(send_backward[0]):
            send_backward = None
        step = Exchange(send_forward, None if recv_forward is None else self.input_of(recv_forward),
                        send_backward, None if recv_backward is None else self.grad_of(recv_backward))
        if step:
            self.steps.append(step)


@PIPELINE_SCHEDULES.register("1f1b")
def one_f_one_b(stages: int, stage: int, micro_batches: int, virtual: int = 1) -> List[Step]:
    """Non-interleaved 1F1B (one model chunk per stage)."""
    assert virtual == 1, "1f1b runs one model chunk per stage (validate the config first)"
    b = _Builder(stages, stage, 1)
    first, last = stage == 0, stage == stages - 1
    warmup = min(stages - stage - 1, micro_batches)
    steady = micro_batches - warmup
    for i in range(warmup):
        b.exchange(recv_forward=None if first else 0)
        b.compute(False, 0, i)
        b.exchange(send_forward=(0, i))
    if steady and not first:
        b.exchange(recv_forward=0)
    for i in range(steady):
        f = warmup + i
        b.compute(False, 0, f)
        b.exchange(send_forward=(0, f), recv_backward=None if last else 0)
        b.compute(True, 0, i)
        b.exchange(send_backward=(0, i), recv_forward=None if first or i == steady - 1 else 0)
    for i in range(steady, micro_batches):
        b.exchange(recv_backward=None if last else 0)
        b.compute(True, 0, i)
        b.exchange(send_backward=(0, i))
    return b.steps


@PIPELINE_SCHEDULES.register("interleaved")
def interleaved(stages: int, stage: int, micro_batches: int, virtual: int = 2) -> List[Step]:
    """Interleaved 1F1B over `virtual` model chunks per stage (Megatron-LM's ordering)."""
    p, v, m = stages, virtual, micro_batches
    assert m % p == 0, "interleaving needs micro-batches divisible by stages (validate the config first)"
    b = _Builder(p, stage, v)
    first, last = stage == 0, stage == p - 1
    total = m * v

    def forward_chunk(k: int) -> int:  # the k-th forward runs this chunk (groups of p micro-batches)
        return (k % (p * v)) // p

    def backward_chunk(k: int) -> int:
        return v - 1 - forward_chunk(k)

    def micro_batch(k: int) -> int:
        return (k // (p * v)) * p + k % p

    all_warmup = m == p
    warmup = total if all_warmup else min((p - stage - 1) * 2 + (v - 1) * p, total)
    steady = total - warmup
    b.exchange(recv_forward=None if first else 0)
    for k in range(warmup):
        b.compute(False, forward_chunk(k), micro_batch(k))
        nxt = forward_chunk(k + 1)
        recv = None if (first and nxt == 0) or k == total - 1 else nxt
        grad = v - 1 if k == warmup - 1 and not all_warmup and not last else None
        b.exchange(send_forward=(forward_chunk(k), micro_batch(k)), recv_forward=recv, recv_backward=grad)
    for k in range(steady):
        fk = k + warmup
        b.compute(False, forward_chunk(fk), micro_batch(fk))
        b.compute(True, backward_chunk(k), micro_batch(k))
        if first:  # the first stage is p - 1 forwards ahead of the last
            nxt_f = forward_chunk(fk - (p - 1))
            recv_f = None if nxt_f == v - 1 else nxt_f + 1
        else:
            recv_f = forward_chunk(fk + 1)
        if last:  # the last stage is p - 1 backwards ahead of the first
            nxt_b = backward_chunk(k - (p - 1))
            recv_b = None if nxt_b == 0 else nxt_b - 1
        else:
            recv_b = backward_chunk(k + 1)
        b.exchange(send_forward=(forward_chunk(fk), micro_batch(fk)), recv_forward=None if k == steady - 1 else recv_f,
                   send_backward=(backward_chunk(k), micro_batch(k)), recv_backward=recv_b)
    if all_warmup and not last:
        b.exchange(recv_backward=v - 1)
    for k in range(steady, total):
        b.compute(True, backward_chunk(k), micro_batch(k))
        nxt = backward_chunk(k + 1)
        recv = None if (last and nxt == v - 1) or k == total - 1 else nxt
        b.exchange(send_backward=(backward_chunk(k), micro_batch(k)), recv_backward=recv)
    return b.steps


def forward_only(stages: int, stage: int, micro_batches: int, virtual: int = 1) -> List[Step]:
    """Evaluation: each micro-batch through every chunk in model order, no backward."""
    b = _Builder(stages, stage, virtual)
    for mb in range(micro_batches):
        for chunk in range(virtual):
            b.exchange(recv_forward=None if b.is_first(chunk) else chunk)
            b.compute(False, chunk, mb)
            b.exchange(send_forward=(chunk, mb))
    return b.steps


def programs(schedule: str, stages: int, micro_batches: int, virtual: int) -> List[List[Step]]:
    """Every stage's program of `schedule` (a `parallel.pipeline_schedule` name)."""
    build = PIPELINE_SCHEDULES.get(schedule)
    return [build(stages, s, micro_batches, virtual) for s in range(stages)]


def expected_bubble(stages: int, micro_batches: int, virtual: int = 1) -> float:
    """Idle fraction of an ideal (interleaved) 1F1B: (p - 1) / (v m + p - 1) (SC'21 §2.2)."""
    return (stages - 1) / (virtual * micro_batches + stages - 1)


# -- simulation -------------------------------------------------------------------------------------
@dataclass
class Simulation:
    makespan: float
    busy: List[float]  # compute time per stage
    bubble: List[float]  # 1 - busy / makespan per stage
    finish: List[float]  # when each stage's program ends (its last compute or message)

    @property
    def mean_bubble(self) -> float:
        return sum(self.bubble) / len(self.bubble)


def _per_stage(value: Union[float, Sequence[float]], stages: int) -> List[float]:
    return [float(value)] * stages if isinstance(value, (int, float)) else [float(v) for v in value]


class _Batch:
    def __init__(self, posted: float):
        self.posted, self.open, self.matched_at, self.done_at = posted, 0, posted, None


def simulate(progs: List[List[Step]], virtual: int, forward_time: Union[float, Sequence[float]] = 1.0,
             backward_time: Union[float, Sequence[float]] = 2.0,
             step_time: Optional[Callable[[int, Compute], float]] = None,
             message_time: Optional[Callable[[int, int], float]] = None) -> Simulation:
    """Run the stages' programs together (module docstring); raise AssertionError on a message that
    does not match, data used before it exists, or a deadlock. A time is one chunk's forward /
    backward of one micro-batch, the same on every stage or one per stage, or `step_time(stage,
    step)` per compute step. Messages take no time, or `message_time(sender, receiver)` seconds
    from when both sides have posted them; a stage's exchange batches complete in order."""
    p = len(progs)
    if step_time is None:
        times = {False: _per_stage(forward_time, p), True: _per_stage(backward_time, p)}

        def step_time(s: int, step: Compute) -> float:
            return times[step.backward][s]
    channels: Dict[tuple, Tuple[deque, deque]] = defaultdict(lambda: (deque(), deque()))  # sends, recvs
    pc, clock, busy = [0] * p, [0.0] * p, [0.0] * p
    batches: List[List[_Batch]] = [[] for _ in range(p)]
    ready: List[Dict[tuple, _Batch]] = [dict() for _ in range(p)]  # ("input" | "grad", chunk, mb) -> batch
    done: List[set] = [set() for _ in range(p)]  # ("F" | "B", chunk, mb) computed

    def model_chunk(s, c):
        return c * p + s

    def match(key, item, is_send):
        sends, recvs = channels[key]
        (sends if is_send else recvs).append(item)
        while sends and recvs:
            (s_time, s_id, s_batch), (r_time, r_id, r_batch) = sends.popleft(), recvs.popleft()
            assert s_id == r_id, f"channel {key}: sent {s_id} but the receiver expects {r_id}"
            arrived = max(s_time, r_time) + (message_time(key[0], key[1]) if message_time else 0.0)
            for batch in (s_batch, r_batch):
                batch.open -= 1
                batch.matched_at = max(batch.matched_at, arrived)

    def post(s, step: Exchange):
        batch = _Batch(clock[s])
        batches[s].append(batch)
        for field, is_send, direction in (("send_forward", True, +1), ("recv_forward", False, -1),
                                          ("send_backward", True, -1), ("recv_backward", False, +1)):
            key = getattr(step, field)
            if key is None:
                continue
            c, mb = key
            k = model_chunk(s, c)
            if is_send:
                assert ("F" if direction > 0 else "B", c, mb) in done[s], \
                    f"stage {s} sends {field} {key} before computing it"
                peer, ident = (s + direction) % p, ("act" if direction > 0 else "grad", k + direction, mb)
                channel = (s, peer, "act" if direction > 0 else "grad")
            else:
                peer, ident = (s + direction) % p, ("act" if direction < 0 else "grad", k, mb)
                channel = (peer, s, ident[0])
                ready[s][("input" if direction < 0 else "grad", c, mb)] = batch
            batch.open += 1
            match(channel, (clock[s], ident, batch), is_send)

    def settle(s):  # a stage's batches complete in order (one NCCL stream)
        previous = 0.0
        for batch in batches[s]:
            if batch.done_at is None:
                if batch.open:
                    return
                batch.done_at = max(batch.matched_at, previous)
            previous = batch.done_at

    def data_time(s, step: Compute) -> Optional[float]:
        c, mb = step.chunk, step.micro_batch
        k = model_chunk(s, c)
        if step.backward:
            assert ("F", c, mb) in done[s], f"stage {s}: backward of {(c, mb)} before its forward"
            needs = None if k == p * virtual - 1 else ("grad", c, mb)
        else:
            needs = None if k == 0 else ("input", c, mb)
        if needs is None:
            return clock[s]
        assert needs in ready[s], f"stage {s}: {step} without a receive of its {needs[0]}"
        settle(s)
        return ready[s][needs].done_at

    progressed = True
    while progressed:
        progressed = False
        for s in range(p):
            while pc[s] < len(progs[s]):
                step = progs[s][pc[s]]
                if isinstance(step, Exchange):
                    post(s, step)
                else:
                    at = data_time(s, step)
                    if at is None:
                        break
                    seconds = step_time(s, step)
                    clock[s] = max(clock[s], at) + seconds
                    busy[s] += seconds
                    done[s].add(("B" if step.backward else "F", step.chunk, step.micro_batch))
                pc[s] += 1
                progressed = True
    stuck = [s for s in range(p) if pc[s] < len(progs[s])]
    assert not stuck, f"deadlock: stages {stuck} wait at steps {[progs[s][pc[s]] for s in stuck]}"
    for s in range(p):
        settle(s)
        assert all(b.done_at is not None for b in batches[s]), f"stage {s}: a message was never matched"
    finish = [max([clock[s]] + [b.done_at for b in batches[s]]) for s in range(p)]
    makespan = max(finish)
    return Simulation(makespan, busy, [1.0 - b / makespan if makespan else 0.0 for b in busy], finish)


@section_check("parallel.pipeline_schedule")
def _check_pipeline(cfg, world_size: int) -> None:
    """Pipeline stages (training/pipeline.py, model/pipeline_stages.py)."""
    par, layers = cfg.parallel, cfg.model.num_layers
    micro_batches = config_micro_batches(cfg, world_size)  # per data-parallel rank and iteration
    PIPELINE_SCHEDULES.get(par.pipeline_schedule)
    if par.virtual_stages < 1:
        raise ConfigError(f"parallel.virtual_stages={par.virtual_stages} must be >= 1")
    if par.pipeline_schedule == "interleaved":
        if par.virtual_stages < 2 or par.pipeline < 2:
            raise ConfigError(f"parallel.pipeline_schedule=interleaved needs parallel.pipeline >= 2 and "
                              f"parallel.virtual_stages >= 2 (got {par.pipeline} and {par.virtual_stages})")
        if micro_batches % par.pipeline:
            raise ConfigError(f"parallel.pipeline_schedule=interleaved needs the {micro_batches} micro-batches per "
                              f"data-parallel rank (training.global_batch_size / (training.micro_batch_size * "
                              f"data parallel)) to be divisible by parallel.pipeline={par.pipeline}")
    elif par.virtual_stages != 1:  # a schedule set explicitly: null resolves to interleaved (config/load.py)
        raise ConfigError(f"parallel.pipeline_schedule={par.pipeline_schedule} contradicts parallel.virtual_stages="
                          f"{par.virtual_stages} ({par.pipeline_schedule} runs one model chunk per stage): leave "
                          f"parallel.pipeline_schedule null (or interleaved), or set parallel.virtual_stages=1")
    chunks = par.pipeline * par.virtual_stages
    if par.pipeline_layers is None:
        if layers % chunks:
            raise ConfigError(f"model.num_layers={layers} is not divisible by parallel.pipeline*parallel.virtual_stages"
                              f"={par.pipeline}*{par.virtual_stages}; set parallel.pipeline_layers for an uneven split")
    else:
        split = list(par.pipeline_layers)
        if len(split) != chunks or any(n < 1 for n in split) or sum(split) != layers:
            raise ConfigError(f"parallel.pipeline_layers={split} must have parallel.pipeline*parallel.virtual_stages="
                              f"{chunks} entries, each >= 1, summing to model.num_layers={layers}")
