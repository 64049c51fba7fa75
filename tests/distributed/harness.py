"""Spawn N processes and run a test function in each (DESIGN.md §8): CPU processes on gloo, or
with `backend="nccl"` one process per GPU (`make test-gpu`).

    results = run_distributed(4, _check_something, layout_kwargs=dict(tensor=2, expert=2), args=(...))

`fn(state: ParallelState, *args)` must be a module-level function (spawned processes import it).
Each worker sets `torch.set_num_threads(1)` (NCCL: `torch.cuda.set_device(rank)`), joins a file
rendezvous, builds the ParallelState of the requested layout, and returns `fn`'s (picklable)
result, loaded on the CPU in the parent. Inside `fn`, `device()` is where its work belongs (the
rank's GPU under NCCL, else the CPU) and `backend()` the backend (for a config's
`parallel.backend`). Worker exceptions are re-raised in the parent with the worker's traceback; a
hard timeout kills everything. NCCL needs a GPU per rank: with fewer, the test is skipped.

Workers fork from the test process's forkserver (`tests/forkserver.py`), which has imported torch
and megatron_moe once: a fresh interpreter per rank would spend ~3.5 s of CPU importing them again.

`BACKENDS` parametrizes a test over both: gloo, and NCCL marked `gpu` (run by `make test-gpu`,
skipped without enough GPUs, deselected by `make test`).
"""
from __future__ import annotations

import io
import os
import queue
import tempfile
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch

from megatron_moe.distributed import collectives
from megatron_moe.distributed.parallel_state import ParallelState, RankLayout
from tests import forkserver


BACKENDS = ["gloo", pytest.param("nccl", marks=pytest.mark.gpu)]
_BACKEND, _DEVICE = "gloo", torch.device("cpu")  # this worker's (set by `_worker`)


def backend() -> str:
    """The process group's backend in this worker: "gloo" or "nccl"."""
    return _BACKEND


def device() -> torch.device:
    """Where this worker's tensors belong: its GPU under NCCL, else the CPU."""
    return _DEVICE


def _worker(rank, world_size, init_file, fn, layout_kwargs, args, results, backend_name):
    global _BACKEND, _DEVICE
    torch.set_num_threads(1)
    state = None
    try:
        if backend_name == "nccl":
            torch.cuda.set_device(rank)
            _BACKEND, _DEVICE = "nccl", torch.device("cuda", rank)
        collectives.init_process_group(backend_name, rank, world_size, init_method=f"file://{init_file}",
                                       timeout_s=120)
        state = ParallelState.build(RankLayout(world_size=world_size, **layout_kwargs), rank)
        out = fn(state, *args)
        # serialize here: tensors put on a Queue directly are shared by file descriptor and can
        # vanish when the worker exits before the parent reads them
        buffer = io.BytesIO()
        torch.save(out, buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        collectives.destroy_process_group(state)


def require_gpus(count: int) -> None:
    """Skip the calling test unless `count` CUDA GPUs are visible (NCCL: one per rank)."""
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < count:
        pytest.skip(f"needs {count} CUDA GPU{'s' if count > 1 else ''} (NCCL, one per rank); found {found}")


def run_distributed(world_size: int, fn: Callable, layout_kwargs: Optional[Dict[str, int]] = None,
                    args: Tuple = (), timeout: float = 240.0, backend: str = "gloo") -> List[Any]:
    """Run `fn(state, *args)` on `world_size` processes (`backend`: gloo on the CPU, or nccl with
    one GPU per rank); return results in rank order (tensors on the CPU)."""
    if backend == "nccl":
        require_gpus(world_size)
    ctx = forkserver.context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_worker, args=(r, world_size, init_file, fn, layout_kwargs or {}, args, results,
                                                   backend), daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        outputs: Dict[int, Any] = {}
        errors: List[str] = []
        try:
            while len(outputs) + len(errors) < world_size:
                try:
                    rank, status, payload = results.get(timeout=timeout)
                except queue.Empty:
                    raise TimeoutError(f"distributed test timed out after {timeout}s "
                                       f"({len(outputs)} of {world_size} ranks finished)") from None
                if status == "ok":
                    outputs[rank] = torch.load(io.BytesIO(payload), weights_only=False, map_location="cpu")
                else:
                    errors.append(f"--- rank {rank} ---\n{payload}")
                    break  # one failure is enough; the others may be stuck in a collective
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 0.5)
                if p.is_alive():
                    p.kill()
        if errors:
            raise RuntimeError("worker failed:\n" + "\n".join(errors))
    return [outputs[r] for r in range(world_size)]


def per_world_spawner(layouts: List[Tuple[int, Dict[str, int]]], fn: Callable, args: Tuple = (),
                      timeout: float = 600.0) -> Callable[..., Dict[str, List[Any]]]:
    """`get(world, backend="gloo")` -> {str(layout_kwargs): [rank 0's result, rank 1's, ...]} for
    every layout of that world size, from ONE spawn of `fn(state, jobs, *args)` (jobs: the
    layouts' kwargs; fn returns one result per job). Process start-up dominates a spawn on 2
    cores, so a module spawns each world size (and backend) once and caches it."""
    cache: Dict[Tuple[int, str], Dict[str, List[Any]]] = {}

    def get(world: int, backend: str = "gloo") -> Dict[str, List[Any]]:
        if (world, backend) not in cache:
            jobs = [kw for w, kw in layouts if w == world]
            outputs = run_distributed(world, fn, jobs[0], args=(jobs, *args), timeout=timeout, backend=backend)
            cache[(world, backend)] = {str(kw): [out[i] for out in outputs] for i, kw in enumerate(jobs)}
        return cache[(world, backend)]

    return get
