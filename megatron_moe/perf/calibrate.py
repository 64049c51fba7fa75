"""Measure the collectives of a hardware profile on the current ranks and fit their alpha-beta
costs (Parm §V-A, §VI-B: time at several message sizes, least squares).

    points = measure_points(state, sizes, reps)         # collective: every rank of `state` calls it
    profile = fit_profile("my_cluster", points, fit)    # pure: works on any timings

Operations, x = elements (fp32 values) in the convention of `distributed/collectives.py`:

* mp_allgather:    MP-AllGather on `tp` whose gathered output has x elements;
* ep_esp_alltoall: EP&ESP-AlltoAll on `ep_esp` with x input elements per rank, split evenly;
* saa:             S2's second EP&ESP-AlltoAll as SAA (`EpEspExchange`, moe/schedules/parm.py):
                   x elements of partial sums per rank, phased over `ep_esp`, with the MP-AllGather
                   of the combined rows on `tp` overlapped.

Each point is the median over `reps` of the slowest rank's time (`perf/timing.py`).
"""
from __future__ import annotations

import statistics
from typing import Callable, Dict, List, Sequence, Tuple

import torch

from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.perf.alpha_beta import fit_alpha_beta
from megatron_moe.perf.hardware import OPS, HardwareProfile
from megatron_moe.perf.timing import slowest_rank_seconds

WIDTH = 64  # elements per row
Points = Dict[str, Tuple[List[int], List[float]]]  # op -> (elements, seconds)


def geometric_sizes(min_elements: int, max_elements: int, points: int) -> List[int]:
    ratio = (max_elements / min_elements) ** (1 / max(1, points - 1))
    return [round(min_elements * ratio ** i) for i in range(points)]


def _rows(elements: int, parts: int) -> int:
    """Rows per part so that `parts` parts of WIDTH-element rows hold about `elements` elements."""
    return max(1, round(elements / (parts * WIDTH)))


def _builders(state: ParallelState, device: torch.device) -> Dict[str, Callable[[int], Tuple[int, Callable]]]:
    """op -> (requested elements -> (elements actually moved, callable that runs the op once))."""
    from megatron_moe.moe.placement import Placement
    from megatron_moe.moe.schedules.parm import EpEspExchange

    tp, ep_esp = state.tp, state.ep_esp

    def allgather(elements):
        piece = torch.randn(_rows(elements, tp.size), WIDTH, device=device)
        return piece.numel() * tp.size, lambda: C.all_gather(piece, tp)

    def alltoall(elements):
        per_peer = _rows(elements, ep_esp.size)
        t = torch.randn(per_peer * ep_esp.size, WIDTH, device=device)
        splits = [per_peer] * ep_esp.size
        return t.numel(), lambda: C.all_to_all_v(t, splits, splits, ep_esp)

    def saa(elements):
        # one expert per EP rank; every ep_esp source sends it `per_source` rows, so each rank holds
        # per_source rows of partial sums from every source and returns them phased (S2's layout)
        per_source = _rows(elements, ep_esp.size)
        counts = torch.full((ep_esp.size, state.ep_size), per_source, dtype=torch.long)
        exchange = EpEspExchange(state, Placement.owner_only(counts, state.ep_size),
                                 [per_source * state.ep_size] * tp.size, saa=True, device=device)
        out = torch.randn(per_source * ep_esp.size, WIDTH, device=device)
        return out.numel(), lambda: exchange.up(out)

    return {"mp_allgather": allgather, "ep_esp_alltoall": alltoall, "saa": saa}


def measure_points(state: ParallelState, sizes: Sequence[int], reps: int, device: torch.device,
                   progress: Callable[[str], None] = lambda _: None) -> Points:
    """Collective: time every op of the profile at every size (one warm-up run each)."""
    points: Points = {}
    for name, build in _builders(state, device).items():
        xs, times = [], []
        for size in sizes:
            elements, run = build(size)
            run()  # warm-up
            xs.append(elements)
            times.append(statistics.median(slowest_rank_seconds(run, state) for _ in range(reps)))
        points[name] = (xs, times)
        progress(f"{name}: {len(sizes)} sizes timed")
    return points


def fit_profile(name: str, points: Points, fit: Dict, description: str = "") -> HardwareProfile:
    """Least-squares alpha-beta of every op (`perf/alpha_beta.py`); the points go into `fit.points`."""
    missing = set(OPS) - points.keys()
    if missing:
        raise ValueError(f"fit_profile: no timings for {sorted(missing)}")
    fits = {op: fit_alpha_beta(*points[op]) for op in OPS}
    fit = dict(fit, points={op: {"elements": list(map(int, points[op][0])),
                                 "seconds": [float(f"{t:.6g}") for t in points[op][1]]} for op in OPS})
    return HardwareProfile(name, description=description, fit=fit, **fits)
