"""Measure a hardware profile on the current ranks (Parm §V-A, §VI-B: time each op at several
sizes, fit alpha + beta x by least squares), for `tools/profile_comm.py` and start-up calibration.

    points = measure_points(state, sizes, reps, device, expert_shape)   # collective
    profile = fit_profile("my_cluster", points, fit)                     # pure: any timings

Operations (`perf/hardware.py`), x = elements (fp32 values) in the convention of
`distributed/collectives.py`, or FLOPs:

* mp_allgather:    MP-AllGather on `tp` whose gathered output has x elements;
* ep_esp_alltoall: EP&ESP-AlltoAll on `ep_esp` with x input elements per rank, split evenly;
* saa:             S2's second EP&ESP-AlltoAll as SAA (`EpEspExchange`, techniques/parm/parm.py):
                   x elements of partial sums per rank, phased over `ep_esp`, with the MP-AllGather
                   of the combined rows on `tp` overlapped;
* p2p:             x elements exchanged between EP ranks 2i and 2i+1 of `ep` (both directions; the
                   last of an odd group idles, so every rank warms `ep` up first, `warm_up_p2p`:
                   NCCL's first batched point-to-point call on a communicator must include all);
* broadcast:       x elements broadcast from EP rank 0 to the others (FasterMoE's shadow transfer);
* expert_compute:  one expert FFN forward (the model's shape, `ExpertShape`) of x FLOPs on each rank.

An op on a group of one rank costs nothing and is recorded as alpha = beta = 0. Each point is
the median over `reps` of the slowest rank's time (`perf/timing.py`), so every rank fits the same
profile.

`measure_links` / `fit_links` time the cluster simulator's link kinds (all-to-all, all-gather,
all-reduce, p2p, broadcast, reduce) on all the ranks and fit its `cluster` block
(`tools/profile_comm.py --links`).

`resolve_hardware_profile(cfg, state)` is what the trainer calls: with `perf.hardware_profile`
unset and a technique that needs one (`moe.schedule: auto`, `moe.balancer: fastermoe`), it
calibrates in a few seconds (or reuses the profile cached for this machine, layout and expert
shape), writes it to the cache and the run directory, says so on the console, and returns the
config pointing at it.
"""
from __future__ import annotations

import os
import platform
import statistics
from dataclasses import replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.parallel_state import ParallelState, warm_up_p2p
from megatron_moe.perf.alpha_beta import AlphaBeta, fit_alpha_beta
from megatron_moe.model.pipeline_stages import STAGE_HOOKS
from megatron_moe.perf.hardware import (OPS, ClusterSpec, ExpertShape, HardwareProfile, Link, expert_shape, load_profile,
                                       profile_needs, save_profile)
from megatron_moe.perf import timing
from megatron_moe.distributed.rank_timing import slowest_rank_seconds

WIDTH = 64  # elements per row
Points = Dict[str, Tuple[List[int], List[float]]]  # op -> (x, seconds); x = [] on a group of one rank
STARTUP_SIZES = (1 << 14, 1 << 17, 1 << 20)  # elements per op at start-up: a few seconds in all
STARTUP_ROWS = (64, 512, 4096)  # expert rows timed at start-up
STARTUP_REPS = 5


def geometric_sizes(min_elements: int, max_elements: int, points: int) -> List[int]:
    ratio = (max_elements / min_elements) ** (1 / max(1, points - 1))
    return [round(min_elements * ratio ** i) for i in range(points)]


def _rows(elements: int, parts: int) -> int:
    """Rows per part so that `parts` parts of WIDTH-element rows hold about `elements` elements."""
    return max(1, round(elements / (parts * WIDTH)))


def _warm_up_once(group) -> Callable[[], None]:
    """`warm_up_p2p(group)` on the first call only (a p2p builder's, not once per size)."""
    done = []

    def warm():
        if not done:
            warm_up_p2p(group)
            done.append(True)
    return warm


def _builders(state: ParallelState, device: torch.device, shape: ExpertShape):
    """op -> (group, requested size -> (x actually measured, callable that runs the op once))."""
    from megatron_moe.moe.grouped_gemm import grouped_mm
    from megatron_moe.moe.placement import Placement
    from megatron_moe.techniques.parm.parm import EpEspExchange

    tp, ep, ep_esp = state.tp, state.ep, state.ep_esp
    warm_up_ep = _warm_up_once(ep)

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

    def p2p(elements):
        send = torch.randn(_rows(elements, 1), WIDTH, device=device)
        recv = torch.empty_like(send)
        peer = ep.rank ^ 1
        pairs = ([(peer, send)], [(peer, recv)]) if peer < ep.size else ([], [])
        warm_up_ep()  # the pairs leave the last rank of an odd group out
        return send.numel(), lambda: C.p2p_exchange(*pairs, ep, kind="p2p").wait()

    def broadcast(elements):
        t = torch.randn(_rows(elements, 1), WIDTH, device=device)
        return t.numel(), lambda: C.broadcast(t, 0, ep)

    def expert_compute(rows):
        x = torch.randn(rows, shape.hidden, device=device)
        w1 = torch.randn(1, shape.hidden, shape.ffn * (2 if shape.gated else 1), device=device) / shape.hidden ** 0.5
        w2 = torch.randn(1, shape.ffn, shape.hidden, device=device)

        def run():
            with torch.no_grad():
                hidden = grouped_mm(x, w1, [rows])
                grouped_mm(hidden[:, : shape.ffn].contiguous(), w2, [rows])
        return rows * shape.flops_per_row, run

    return {"mp_allgather": (tp, allgather), "ep_esp_alltoall": (ep_esp, alltoall), "saa": (ep_esp, saa),
            "p2p": (ep, p2p), "broadcast": (ep, broadcast), "expert_compute": (None, expert_compute)}


def measure_points(state: ParallelState, sizes: Sequence[int], reps: int, device: torch.device,
                   shape: ExpertShape = ExpertShape(), rows: Sequence[int] = STARTUP_ROWS,
                   ops: Sequence[str] = OPS, progress: Callable[[str], None] = lambda _: None) -> Points:
    """Collective: time every op in `ops` at every size (rows for expert_compute), one warm-up each."""
    points: Points = {}
    for name, (group, build) in _builders(state, device, shape).items():
        if name not in ops:
            continue
        xs, times = [], []
        if group is None or group.size > 1:
            for size in (rows if name == "expert_compute" else sizes):
                x, run = build(size)
                run()  # warm-up
                xs.append(x)
                times.append(statistics.median(slowest_rank_seconds(run, state, device) for _ in range(reps)))
        points[name] = (xs, times)
        progress(f"{name}: {len(xs)} sizes timed" if xs else f"{name}: group of one rank, no cost")
    return points


def _link_builders(state: ParallelState, device: torch.device):
    """The cluster block's collectives (`perf/hardware.py` LINK_KINDS) on the world group, each
    size -> (x in the cluster convention, callable): all-to-all x = elements a rank sends to the
    others (evenly), all-gather x = gathered elements, all-reduce / broadcast / reduce x = the
    tensor's elements, p2p x = elements world ranks 2i and 2i+1 send each other (warmed up as
    `_builders`' p2p)."""
    world, n = state.world, state.world_size
    warm_up_world = _warm_up_once(world)

    def tensor(elements, parts=1):
        return torch.randn(_rows(elements, parts), WIDTH, device=device)

    def all_to_all(elements):
        t = tensor(elements * n / max(n - 1, 1), n)
        splits = [t.shape[0] // n] * n
        t = t[: splits[0] * n]
        return splits[0] * (n - 1) * WIDTH, lambda: C.all_to_all_v(t, splits, splits, world)

    def all_gather(elements):
        piece = tensor(elements, n)
        return piece.numel() * n, lambda: C.all_gather(piece, world)

    def p2p(elements):
        send = tensor(elements)
        recv, peer = torch.empty_like(send), world.rank ^ 1
        pairs = ([(peer, send)], [(peer, recv)]) if peer < n else ([], [])
        warm_up_world()  # as `_builders`' p2p
        return send.numel(), lambda: C.p2p_exchange(*pairs, world, kind="p2p").wait()

    def whole(op):
        def build(elements):
            t = tensor(elements)
            return t.numel(), lambda: op(t)
        return build

    return {"all_to_all": all_to_all, "all_gather": all_gather, "all_reduce": whole(lambda t: C.all_reduce(t, world)),
            "p2p": p2p, "broadcast": whole(lambda t: C.broadcast(t, 0, world)),
            "reduce": whole(lambda t: C.reduce_async(t, 0, world).wait())}


def measure_links(state: ParallelState, sizes: Sequence[int], reps: int, device: torch.device,
                  progress: Callable[[str], None] = lambda _: None) -> Points:
    """Collective: time every cluster link kind on the world group at every size (one warm-up)."""
    points: Points = {}
    for kind, build in _link_builders(state, device).items():
        xs, times = [], []
        for size in sizes:
            x, run = build(size)
            run()
            xs.append(x)
            times.append(statistics.median(slowest_rank_seconds(run, state, device) for _ in range(reps)))
        points[kind] = (xs, times)
        progress(f"{kind}: {len(xs)} sizes timed on {state.world_size} ranks")
    return points


def recorded(points: Points) -> Dict[str, Dict[str, list]]:
    """`points` as a profile records them: {op: {"x": sizes, "seconds": times to 6 significant
    digits}}. Fits are made from these, so a profile's fit is exactly that of the points it holds."""
    return {op: {"x": [float(x) for x in xs], "seconds": [float(f"{t:.6g}") for t in ts]}
            for op, (xs, ts) in points.items()}


def fit_links(points: Points, node_size: Optional[int] = None) -> ClusterSpec:
    """The cluster block of one machine's measured links (every rank on one node: `intra`), fitted
    to the `recorded` points."""
    kept = recorded(points)
    return ClusterSpec(node_size, {kind: Link(fit_alpha_beta(p["x"], p["seconds"])) for kind, p in kept.items()})


def fit_profile(name: str, points: Points, fit: Dict, description: str = "") -> HardwareProfile:
    """Least-squares alpha-beta of every op in `points` (`perf/alpha_beta.py`); an op measured on a
    group of one rank (no points) costs 0. The `recorded` points, which the fits are made from, go
    into `fit.points`."""
    unknown = set(points) - set(OPS)
    if unknown or not points:
        raise ValueError(f"fit_profile: timings for unknown ops {sorted(unknown)}" if unknown else
                         "fit_profile: no timings")
    kept = recorded(points)
    fits = {op: fit_alpha_beta(p["x"], p["seconds"]) if p["x"] else AlphaBeta(0.0, 0.0) for op, p in kept.items()}
    return HardwareProfile(name, description=description, fit=dict(fit, points=kept), **fits)


def fit_description(state: ParallelState, tool: str, reps: int, shape: ExpertShape) -> Dict:
    from megatron_moe.distributed.launch import pick_backend

    lay = state.layout
    return {"tool": tool, "world_size": state.world_size, "host": platform.node(), "reps": reps,
            "layout": {"tensor": lay.tensor, "expert": lay.expert, "expert_shard": lay.expert_shard},
            "backend": pick_backend("auto") if state.world_size > 1 else "none", "torch": str(torch.__version__),
            "expert_shape": {"hidden": shape.hidden, "ffn": shape.ffn, "gated": shape.gated}}


# -- start-up calibration --------------------------------------------------------------------------
def cache_path(state: ParallelState, shape: ExpertShape, directory: Optional[str] = None) -> str:
    """Where the calibrated profile of this machine, layout and expert shape is cached
    (`perf.calibration_cache`, default `<cache dir>/hardware`)."""
    from megatron_moe.data.cache import default_cache_dir, description_hash

    key = fit_description(state, "", 0, shape)
    key.pop("reps"), key.pop("tool")
    directory = directory or os.path.join(default_cache_dir(), "hardware")
    return os.path.join(directory, f"{platform.node()}-{description_hash(key)}.yaml")


def resolve_hardware_profile(cfg, state: ParallelState, device: torch.device,
                             say: Callable[[str], None] = print, run_dir_copy: bool = True):
    """`cfg` unchanged if it names a profile or needs none; else `cfg` with `perf.hardware_profile`
    set to a profile calibrated on these ranks (or cached), copied into the run directory unless
    `run_dir_copy` is false. Collective (over the world) when it calibrates."""
    needs = profile_needs(cfg)
    if cfg.perf.hardware_profile or not needs:
        return cfg
    shape = expert_shape(cfg, state)
    path = cache_path(state, shape, cfg.perf.calibration_cache)
    cached = load_profile(path) if state.rank == 0 and os.path.isfile(path) else None
    profile = C.broadcast_object(cached, 0, state.world)  # rank 0's cache decides, so all ranks agree
    if profile is None:
        watch = timing.Stopwatch(device)
        points = measure_points(state, STARTUP_SIZES, STARTUP_REPS, device, shape)
        profile = fit_profile(f"calibrated-{platform.node()}", points,
                              fit_description(state, "start-up", STARTUP_REPS, shape),
                              f"calibrated at start-up on {state.world_size} ranks")
        message = f"calibrated in {watch.seconds():.1f} s on {state.world_size} ranks"
    else:
        message = "reused from the cache (delete the file to measure again)"
    for ops, who in needs:
        profile.require(ops, who)
    save_profile(profile, path)
    if state.rank == 0:
        copied = ""
        if run_dir_copy:
            save_profile(profile, os.path.join(cfg.training.run_dir, "hardware_profile.yaml"))
            copied = f" (copied to {cfg.training.run_dir}/hardware_profile.yaml)"
        say(f"perf: hardware profile for {', '.join(who for _, who in needs)} {message}: {path}{copied}; "
            "set perf.hardware_profile to use your own")
    return replace(cfg, perf=replace(cfg.perf, hardware_profile=path))


@STAGE_HOOKS.register("perf.hardware_profile")
def _stage_profile(cfg, state: ParallelState, device: torch.device):
    """A stage's model calibrates as the trainer does when a technique needs a profile and the config
    names none (collective; a no-op when the trainer already did), without the run-directory copy."""
    return resolve_hardware_profile(cfg, state, device, run_dir_copy=False)
