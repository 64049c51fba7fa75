"""The only module that calls torch.distributed (DESIGN.md §6). Counts bytes and time per op kind.

Every op takes a `Group` from `ParallelState` and is a no-op (no bytes counted) on a group of
size 1; it raises if a tensor is not on the group's device (`Group.check_device`: NCCL has no CPU
backend; tensors built on the host go through `Group.to_device` first). Byte counts use Parm's
notation for a collective's message size x (Parm §IV, Eq. 1):

    all_reduce      x = bytes of the tensor
    all_gather      x = bytes of the gathered output (all ranks' pieces)
    reduce_scatter  x = bytes of the input (before scattering)
    all_to_all      x = bytes of this rank's input (all splits, including the one it keeps)
    broadcast       the root: bytes of the tensor x (size - 1) receivers; the others 0
    reduce          every rank but the root: bytes of its tensor; the root 0
    p2p_exchange    bytes of the tensors it sends (pipeline stages: kind `pipeline`); the bytes
                    it receives go to `COMM_STATS.received` under the same key

Time is recorded twice per op: *total* (the op's span) and *exposed* (the time the caller was
blocked by it). A synchronous op's exposed time is its total. An asynchronous op
(`all_gather_v_async`, `p2p_exchange`) returns a `Pending` handle: its bytes are counted when it
is issued; its exposed time is the issue call plus the time blocked in `Pending.wait()`, its
total the span from issue until the op completed. Exposed < total is communication hidden behind
other work. Every time is taken by `perf/timing.py` on the device of the op's tensors: the host
clock for gloo's CPU tensors (completion = when `wait()` returns, an upper bound: gloo reports no
completion time), CUDA events on the stream that runs the work for NCCL (exposed: around the
wait on the compute stream; completion: an event on a stream that waits for the collective),
read lazily: no op waits for the GPU to be timed, the times are read when asked for.
All-to-all and point-to-point ops also count the bytes they send to ranks on other nodes
(`RankLayout.ranks_per_node`, `parallel.ranks_per_node`) in `COMM_STATS.inter_node`.
A caller that wants its own ops' times apart (an MoE layer's *Trans* / *Agg*) passes a `TimeSink`
to the async ops; `Pending.wait()` adds to it as well. `all_to_all_v(..., while_in_flight=fn)`
runs `fn` while the all-to-all is in flight (Pro-Prophet's `Plan`, Alg. 2 line 6).

Counters are keyed ``"<kind>/<group name>"`` (e.g. ``"all_gather/esp"``) and are per process;
`COMM_STATS.snapshot()` returns the bytes, `COMM_STATS.seconds_by_kind()` the times,
`COMM_STATS.reset()` clears them; a side channel passed as a group of its own (`Group.side_channel()`:
Trans / Agg, moe/replicas.py; overlapped gradient buckets) counts as ``"<group>_side"``. Differentiable
wrappers (`all_to_all_v_autograd`, ...) count their backward communication too. Inside `COMM_STATS.tagging(tag)`
the bytes also go to `COMM_STATS.tagged` under ``"<kind>/<group name>#<tag>"`` (e.g. Pro-Prophet's SubAgg1 / 2).
"""
from __future__ import annotations

import gc
import math
from contextlib import contextmanager
from datetime import timedelta
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_moe.distributed.comm_stats import (COMM_STATS, CommStats, TimeSink, backward_phase,  # noqa: F401
                                                 resolved)  # (C.COMM_STATS, C.TimeSink, ...: collectives' names)
from megatron_moe.distributed.group import Group
from megatron_moe.perf import timing
from megatron_moe.perf.host_sync import to_host

# the tensor forms of reduce-scatter / all-gather (torch 2.13 renames them `*_single`)
_REDUCE_SCATTER_TENSOR = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER_INTO = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@contextmanager
def _timed(kind: str, group: Group, nbytes: int, inter_node: int = 0, device=None):
    """A synchronous op on tensors of `device` (None: host-blocking, e.g. object collectives; else
    checked against the group's device: `Group.check_device`)."""
    if device is not None:
        group.check_device(device)
    with timing.span(device) as span:
        yield
    COMM_STATS.record(kind, group, nbytes, span.duration, inter_node)


def _off_node_bytes(group: Group, per_peer: Sequence[Tuple[int, int]]) -> int:
    """Bytes of (group rank, bytes) pairs whose peer is on another node."""
    return sum(n for i, n in per_peer if group.off_node(i))


# ---- process-group management ---------------------------------------------------------------

def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def init_process_group(backend: str, rank: int, world_size: int, init_method: str = "env://",
                       timeout_s: float = 600.0) -> None:
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, init_method=init_method,
                            timeout=timedelta(seconds=timeout_s))


def destroy_process_group(state=None) -> None:
    """Destroy every process group and join gloo's worker threads before the interpreter exits.

    A gloo worker thread releases the tensors of an op it ran after the caller has already
    returned, and releasing them takes the GIL. If the interpreter is finalizing by then, that
    thread is unwound inside a destructor: "terminate called without an active exception", SIGABRT,
    after a run that otherwise succeeded. A group's threads are joined (without the GIL) when its
    last Python reference goes, so drop the handles `state` (a ParallelState) holds and collect.
    Call it on every rank at the end of a run; a barrier before it is the caller's business (it
    would hang on an error path where another rank is gone)."""
    if is_initialized():
        dist.destroy_process_group()
    if state is not None:
        for group in state.groups.values():
            group.handle = None
    gc.collect()


def new_group(ranks: Sequence[int]):
    return dist.new_group(ranks=list(ranks))


def barrier(group: Group) -> None:
    if group.size > 1:
        dist.barrier(group=group.handle)


# ---- raw collectives (no autograd) -------------------------------------------------------------

def all_reduce(t: torch.Tensor, group: Group, op: str = "sum", kind: str = "all_reduce") -> torch.Tensor:
    """In-place all-reduce; returns `t`. `op`: sum | max | min. `kind` labels the traffic."""
    if group.size == 1:
        return t
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    with _timed(kind, group, _nbytes(t), device=t.device):
        dist.all_reduce(t, op=reduce_op, group=group.handle)
    return t


def all_gather(t: torch.Tensor, group: Group, dim: int = 0, kind: str = "all_gather",
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Concatenate equal-shaped tensors from every rank of `group` along `dim` (rank order), with
    the tensor form (`all_gather_into_tensor`: NCCL's list form copies every piece out of a scratch
    buffer). `kind` lets a caller label the traffic (e.g. routing metadata apart from hidden states).
    `out` (dim 0, contiguous): receive straight into it; `t` may be this rank's piece of it (in place)."""
    if group.size == 1:
        return t
    t = t.contiguous()
    buf = out if out is not None else t.new_empty((group.size * t.shape[0],) + tuple(t.shape[1:]))
    with _timed(kind, group, _nbytes(t) * group.size, device=t.device):
        _ALL_GATHER_INTO(buf, t, group=group.handle)
    return buf if out is not None or dim == 0 else torch.cat(buf.chunk(group.size), dim=dim)


def all_gather_object(obj, group: Group, kind: str = "all_gather_object") -> list:
    """Every rank's picklable `obj`, in rank order (for small metadata; bytes are not counted)."""
    if group.size == 1:
        return [obj]
    out = [None] * group.size
    with _timed(kind, group, 0):
        dist.all_gather_object(out, obj, group=group.handle)
    return out


def broadcast_object(obj, src_index: int, group: Group, kind: str = "broadcast_object"):
    """Rank `src_index`'s picklable `obj` on every rank of `group` (small metadata; bytes not counted)."""
    if group.size == 1:
        return obj
    box = [obj]
    with _timed(kind, group, 0):
        dist.broadcast_object_list(box, src=group.global_rank(src_index), group=group.handle)
    return box[0]


def backend_device(handle) -> torch.device:
    """Where the tensors of collectives on process group `handle` must live (`Group.device`):
    NCCL the current GPU, gloo the CPU."""
    if dist.get_backend(handle) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_sizes(n: int, group: Group, kind: str = "all_gather") -> List[int]:
    """Every rank's integer `n` (e.g. a token count), in rank order. Counted as `kind` bytes."""
    if group.size == 1:
        return [n]
    sizes = torch.tensor([n], dtype=torch.int64, device=group.device or backend_device(group.handle))
    return to_host(all_gather(sizes, group, kind=kind), "sizes").tolist()  # a host sync (perf/host_sync.py)


def _gather_buffers(t: torch.Tensor, group: Group, sizes: List[int]):
    """gloo/NCCL all_gather needs equal shapes: pad `t` to the largest size; (send buffer, receive pieces)."""
    buf = t.new_zeros((max(sizes),) + tuple(t.shape[1:]))
    buf[: t.shape[0]] = t
    return buf, [torch.empty_like(buf) for _ in range(group.size)]


def _row_bytes(t: torch.Tensor) -> int:
    return t.element_size() * math.prod(t.shape[1:])


def all_gather_v(t: torch.Tensor, group: Group, sizes: Optional[List[int]] = None,
                 kind: str = "all_gather") -> torch.Tensor:
    """Concatenate tensors whose dim-0 sizes differ per rank. `sizes` (every rank's dim 0) may be
    given when already known; otherwise it is exchanged first. Counts the unpadded payload."""
    if group.size == 1:
        return t
    if sizes is None:
        sizes = all_gather_sizes(t.shape[0], group, kind)
    buf, pieces = _gather_buffers(t, group, sizes)
    with _timed(kind, group, _row_bytes(t) * sum(sizes), device=t.device):
        dist.all_gather(pieces, buf, group=group.handle)
    return torch.cat([p[:n] for p, n in zip(pieces, sizes)], dim=0)


class Pending:
    """An asynchronous op in flight. `wait()` blocks until it is done (on CUDA: makes the current
    stream wait), records its exposed and total time (module docstring) once, and returns
    `result()` (None for point-to-point)."""

    def __init__(self, kind: str, group: Optional[Group], works: Sequence, result: Callable[[], object] = lambda: None,
                 clock: Optional[timing.AsyncTiming] = None, keep: object = None, sink: Optional[TimeSink] = None):
        self.kind, self.group, self.works, self._result = kind, group, list(works), result
        self._clock = clock
        self._keep = keep  # the tensors in flight stay alive until wait()
        self._sink = sink
        self._done = False

    @classmethod
    def completed(cls, result: Callable[[], object] = lambda: None) -> "Pending":
        """A handle for work that needed no communication (a group of size 1, nothing to send)."""
        return cls("", None, [], result)

    def wait(self):
        if not self._done:
            if self._clock is None:
                for work in self.works:
                    work.wait()
            else:
                exposed, total = self._clock.wait(self.works)
                COMM_STATS.record_time(self.kind, self.group, total, exposed)
                if self._sink is not None:
                    self._sink.add(self.kind, exposed, total)
            self._done, self._keep, self.works = True, None, []
        return self._result()


def _issue(kind: str, group: Group, nbytes: int, start_ops: Callable[[], Sequence], device,
           result: Callable[[], object] = lambda: None, keep: object = None, inter_node: int = 0,
           sink: Optional[TimeSink] = None) -> Pending:
    """Count `nbytes`, start the async ops on tensors of `device` and return their handle
    (holding `keep` until done)."""
    group.check_device(device)
    COMM_STATS.record_bytes(kind, group, nbytes, inter_node)
    clock = timing.AsyncTiming(device)
    works = start_ops()
    clock.issued()
    return Pending(kind, group, works, result, clock, keep, sink)


def all_gather_v_async(t: torch.Tensor, group: Group, sizes: List[int], kind: str = "all_gather") -> Pending:
    """Start an `all_gather_v` and return at once, so that communication on another group can run
    meanwhile (Parm's SAA); `wait()` returns the concatenation. `sizes`: every rank's dim 0."""
    if group.size == 1:
        return Pending.completed(lambda: t)
    buf, pieces = _gather_buffers(t, group, sizes)
    return _issue(kind, group, _row_bytes(t) * sum(sizes),
                  lambda: [dist.all_gather(pieces, buf, group=group.handle, async_op=True)], t.device,
                  lambda: torch.cat([p[:n] for p, n in zip(pieces, sizes)], dim=0), keep=buf)


def reduce_scatter(t: torch.Tensor, group: Group, kind: str = "reduce_scatter") -> torch.Tensor:
    """Sum over ranks, then keep this rank's equal slice along dim 0, with the tensor form
    (`reduce_scatter_tensor`; NCCL's list form copies every chunk into one buffer). `kind`: the traffic's label."""
    if group.size == 1:
        return t
    t = t.contiguous()
    out = t.new_empty((t.shape[0] // group.size,) + tuple(t.shape[1:]))
    with _timed(kind, group, _nbytes(t), device=t.device):
        _REDUCE_SCATTER_TENSOR(out, t, group=group.handle)
    return out


def all_reduce_async(t: torch.Tensor, group: Group, kind: str = "all_reduce", sink: Optional[TimeSink] = None):
    """Start an in-place sum of `t` over `group` (a Pending; `wait()` returns `t`). Overlapped
    gradient buckets pass a side channel, `Group.side_channel()` (training/grads.py)."""
    if group.size == 1:
        return Pending.completed(lambda: t)
    return _issue(kind, group, _nbytes(t), lambda: [dist.all_reduce(t, group=group.handle, async_op=True)], t.device,
                  lambda: t, keep=t, sink=sink)


def reduce_scatter_async(t: torch.Tensor, group: Group, kind: str = "reduce_scatter", sink: Optional[TimeSink] = None):
    """Start `reduce_scatter(t, group)` (1-D `t`, the tensor form); `wait()` returns this rank's slice."""
    out = t.new_empty(t.shape[0] // group.size)
    return Pending.completed(lambda: t) if group.size == 1 else _issue(kind, group, _nbytes(t), lambda: [
        _REDUCE_SCATTER_TENSOR(out, t, group=group.handle, async_op=True)], t.device, lambda: out, keep=t, sink=sink)


def all_to_all_v(t: torch.Tensor, send_splits: List[int], recv_splits: List[int], group: Group,
                 kind: str = "all_to_all", while_in_flight: Optional[Callable[[], None]] = None) -> torch.Tensor:
    """Send rows `send_splits[i]` of `t` (dim 0, in order) to rank i of `group`; receive
    `recv_splits[i]` rows from rank i. `kind` lets a caller label the traffic (counted bytes).
    `while_in_flight`: work to run on this thread while the all-to-all is in flight (asynchronous
    then; still exactly one all-to-all)."""
    if group.size == 1:
        if while_in_flight is not None:
            while_in_flight()
        return t
    t = t.contiguous()
    out = t.new_empty((sum(recv_splits),) + tuple(t.shape[1:]))
    inter = _off_node_bytes(group, [(i, n * _row_bytes(t)) for i, n in enumerate(send_splits)])

    def start(async_op: bool):
        return dist.all_to_all_single(out, t, output_split_sizes=list(recv_splits),
                                      input_split_sizes=list(send_splits), group=group.handle, async_op=async_op)

    if while_in_flight is None:
        with _timed(kind, group, _nbytes(t), inter, device=t.device):
            start(False)
        return out
    pending = _issue(kind, group, _nbytes(t), lambda: [start(True)], t.device, keep=t, inter_node=inter)
    while_in_flight()
    pending.wait()
    return out


def exchange_counts(send_counts: torch.Tensor, group: Group) -> torch.Tensor:
    """All-to-all of per-destination counts: `send_counts[i]` (a row of ints) goes to rank i.
    Returns [group.size, ...] counts received from each rank."""
    if group.size == 1:
        return send_counts.clone()
    rows = send_counts.shape[0]
    assert rows == group.size
    flat = send_counts.reshape(rows, -1).to(torch.int64)
    width = flat.shape[1]
    out = all_to_all_v(flat.reshape(-1), [width] * rows, [width] * rows, group, kind="all_to_all_counts")
    return out.reshape(send_counts.shape).to(send_counts.dtype)


def broadcast(t: torch.Tensor, src_index: int, group: Group) -> torch.Tensor:
    """In-place broadcast from rank `src_index` of `group`."""
    if group.size == 1:
        return t
    with _timed("broadcast", group, _nbytes(t) * (group.size - 1) if group.rank == src_index else 0, device=t.device):
        dist.broadcast(t, src=group.global_rank(src_index), group=group.handle)
    return t


def broadcast_async(t: torch.Tensor, src_index: int, group: Group, kind: str = "broadcast",
                    sink: Optional[TimeSink] = None) -> Pending:
    """Start an in-place broadcast of `t` from rank `src_index` of `group`; `wait()` before reading `t`."""
    if group.size == 1:
        return Pending.completed()
    nbytes = _nbytes(t) * (group.size - 1) if group.rank == src_index else 0
    return _issue(kind, group, nbytes, lambda: [dist.broadcast(t, src=group.global_rank(src_index), group=group.handle,
                                                                async_op=True)], t.device, keep=t, sink=sink)


def reduce_async(t: torch.Tensor, dst_index: int, group: Group, kind: str = "reduce",
                 sink: Optional[TimeSink] = None) -> Pending:
    """Start a sum of every rank's `t` into `t` on rank `dst_index` of `group` (others' `t` undefined after)."""
    if group.size == 1:
        return Pending.completed()
    nbytes = 0 if group.rank == dst_index else _nbytes(t)
    return _issue(kind, group, nbytes, lambda: [dist.reduce(t, dst=group.global_rank(dst_index), op=dist.ReduceOp.SUM,
                                                             group=group.handle, async_op=True)], t.device, keep=t,
                  sink=sink)


def p2p_exchange(sends: Sequence[Tuple], recvs: Sequence[Tuple], group: Group, kind: str = "send", tag: int = 0,
                 sink: Optional[TimeSink] = None, side: bool = False) -> Pending:
    """Post point-to-point sends `(group rank, tensor)` and receives `(group rank, buffer)` together
    (batch_isend_irecv, as NCCL needs) and return one handle to wait on. Counts the bytes sent as
    `kind` (the bytes received in `COMM_STATS.received`; both when posted). Empty tensors are
    skipped (both sides know the sizes); never pass this rank itself.
    Messages between two ranks match in posting order (and by tag where the backend uses tags: an
    entry may carry its own, `(group rank, tensor, tag)`; `tag` is the default). `side`: on the
    group's side channel (`Group.side_handle`) where it has one, so that the messages can stay in
    flight while collectives run on the group."""
    handle = group.side_handle if side and group.side_handle is not None else group.handle
    for item in (*sends, *recvs):
        group.check_device(item[1].device)

    def op(fn, item):
        i, t = item[0], item[1]
        return dist.P2POp(fn, t.contiguous() if fn is dist.isend else t, group.global_rank(i), handle,
                          item[2] if len(item) > 2 else tag)

    ops = [op(dist.isend, item) for item in sends if item[1].numel()]
    ops += [op(dist.irecv, item) for item in recvs if item[1].numel()]
    if not ops:
        return Pending.completed()
    device = (list(sends) + list(recvs))[0][1].device
    COMM_STATS.record_received(kind, group, sum(_nbytes(item[1]) for item in recvs))
    return _issue(kind, group, sum(_nbytes(item[1]) for item in sends), lambda: dist.batch_isend_irecv(ops), device,
                  keep=ops,
                  inter_node=_off_node_bytes(group, [(item[0], _nbytes(item[1])) for item in sends]), sink=sink)


# ---- differentiable wrappers --------------------------------------------------------------------

class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group, kind, while_in_flight, backward_fill):
        ctx.save = (send_splits, recv_splits, group, kind, backward_fill)
        return all_to_all_v(x, send_splits, recv_splits, group, kind, while_in_flight)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits, group, kind, fill = ctx.save
        in_flight = (lambda: fill(grad.numel())) if fill is not None else None
        return all_to_all_v(grad, recv_splits, send_splits, group, kind, in_flight), None, None, None, None, None, None


def all_to_all_v_autograd(x: torch.Tensor, send_splits: List[int], recv_splits: List[int], group: Group,
                          kind: str = "all_to_all", while_in_flight: Optional[Callable[[], None]] = None,
                          backward_fill: Optional[Callable[[int], None]] = None) -> torch.Tensor:
    """all_to_all_v whose backward is the reverse all_to_all_v. `while_in_flight`: work during the
    forward's; `backward_fill(elements)`: work during the backward's (Lancet's deferred dW)."""
    if group.size == 1:
        if while_in_flight is not None:
            while_in_flight()
        return x
    return _AllToAllV.apply(x, list(send_splits), list(recv_splits), group, kind, while_in_flight, backward_fill)


def _own_rows(x: torch.Tensor, group: Group, sizes: List[int]) -> torch.Tensor:
    start = sum(sizes[: group.rank])
    return x[start: start + sizes[group.rank]]


class _AllGatherV(torch.autograd.Function):
    """y (same on every rank) = cat_r x_r. Backward `reduce_scatter`: dx_r = sum over ranks s of
    dy_s[rows of r] (each rank's copy of y is used differently downstream). Backward `split`:
    dx_r = dy_r[rows of r] (every rank's dy is already the full gradient of its copy, e.g. after a
    `split_v_autograd` whose backward all-gathers; Megatron's gather/split pair)."""

    @staticmethod
    def forward(ctx, x, group, sizes, kind, backward):
        ctx.save = (group, sizes, backward)
        return all_gather_v(x, group, sizes, kind)

    @staticmethod
    def backward(ctx, grad):
        group, sizes, backward = ctx.save
        if backward == "split":
            return _own_rows(grad, group, sizes), None, None, None, None
        # reduce-scatter-v: send rows of rank i to rank i, sum what arrives
        received = all_to_all_v(grad, sizes, [sizes[group.rank]] * group.size, group, kind="reduce_scatter")
        dx = received.reshape((group.size, sizes[group.rank]) + tuple(grad.shape[1:])).sum(0)
        return dx, None, None, None, None


def all_gather_v_autograd(x: torch.Tensor, group: Group, sizes: Optional[List[int]] = None,
                          kind: str = "all_gather", backward: str = "reduce_scatter") -> torch.Tensor:
    """all_gather_v whose backward reduce-scatters (default) or keeps this rank's rows (`split`)."""
    assert backward in ("reduce_scatter", "split"), backward
    if group.size == 1:
        return x
    if sizes is None:
        sizes = all_gather_sizes(x.shape[0], group, kind)
    return _AllGatherV.apply(x, group, list(sizes), kind, backward)


class _SplitV(torch.autograd.Function):
    """y_r = rows of rank r of x (x replicated over the group) => dx = cat_r dy_r (all-gather)."""

    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.save = (group, sizes)
        return _own_rows(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        group, sizes = ctx.save
        return all_gather_v(grad.contiguous(), group, sizes), None, None


def split_v_autograd(x: torch.Tensor, group: Group, sizes: List[int]) -> torch.Tensor:
    """Keep this rank's `sizes[rank]` rows of a group-replicated `x` (no communication); the
    backward all-gathers the rows' gradients (Parm §IV-A: ESP-Split costs an ESP-AllGather in
    backpropagation)."""
    if group.size == 1:
        return x
    return _SplitV.apply(x, group, list(sizes))


class _AllReduceSum(torch.autograd.Function):
    """y_r = sum_s x_s on every rank => dx_s = sum_r dy_r (another all-reduce)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.clone(), ctx.group), None


def all_reduce_autograd(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum over `group` with the mathematically complete backward (all-reduce of the gradients).
    For Megatron's identity-backward all-reduce use `tensor_parallel.mappings`."""
    if group.size == 1:
        return x
    return _AllReduceSum.apply(x, group)
