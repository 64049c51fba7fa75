"""`plan`: every run checked by the entry point's own `--check-config --world-size N` before anything
starts, the plan written to `<sweep_dir>/sweep.json`, and with `--simulate PROFILE` the points ranked
by the cluster simulator (megatron_moe/sim, the engine of tools/simulate.py).

`check_run` executes `ENTRY --check-config --world-size N --config BASE overrides...` in this
process (runpy, the script's `__main__` block), so checking many runs costs one import of the
training stack rather than one interpreter each; the answer is the one the launchers get.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import sys
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_moe.config import ConfigError, load_config
from megatron_moe.sweep.spec import ROOT, Run, SweepSpec, shown

PLAN_FILE = "sweep.json"


def check_run(spec: SweepSpec, run: Run) -> Optional[str]:
    """None if the entry point accepts the run's config for its world size, else its error line."""
    argv = [spec.entry, "--check-config", "--world-size", str(run.launch.world_size), "--config", spec.base,
            *run.overrides]
    out, err = io.StringIO(), io.StringIO()
    saved = sys.argv
    sys.argv = argv
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(str(ROOT / spec.entry), run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = saved
    if code == 0:
        return None
    lines = [line.strip() for line in (err.getvalue() + out.getvalue()).splitlines() if line.strip()]
    line = lines[-1] if lines else f"--check-config exited with {code}"
    return line.removeprefix("config error: ")


def check_runs(spec: SweepSpec, runs: Sequence[Run]) -> List[str]:
    """One line per run the entry point rejects: `run 'NAME': <the config error naming the key>`."""
    return [f"run {run.name!r}: {error}" for run in runs if (error := check_run(spec, run)) is not None]


def train_iters(spec: SweepSpec, run: Run) -> int:
    return load_config(spec.base, run.overrides).training.train_iters


def plan_record(spec: SweepSpec, runs: Sequence[Run]) -> Dict:
    """What `status` and `report` need without the sweep file: the runs, their keys and directories."""
    return {
        "name": spec.name, "sweep_file": spec.path, "base": spec.base, "entry": spec.entry,
        "sweep_dir": spec.sweep_dir, "backend": spec.launch.get("backend", "local"),
        "varied_keys": spec.varied_keys, "metrics": list(spec.metrics),
        "report": {"value": spec.report.value, "last_n": spec.report.last_n, "group_by": spec.report.group_by},
        "runs": [{"index": r.index, "name": r.name, "point": r.point, "varied": [[k, v] for k, v in r.varied],
                  "overrides": r.overrides, "world_size": r.launch.world_size, "launch": r.launch.describe(),
                  "run_dir": r.run_dir, "train_iters": train_iters(spec, r)} for r in runs],
    }


def write_plan(spec: SweepSpec, runs: Sequence[Run]) -> Dict:
    record = plan_record(spec, runs)
    os.makedirs(spec.sweep_dir, exist_ok=True)
    path = os.path.join(spec.sweep_dir, PLAN_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(path + ".tmp", path)
    return record


def read_plan(sweep_dir: str) -> Dict:
    path = os.path.join(sweep_dir, PLAN_FILE)
    if not os.path.isfile(path):
        raise ConfigError(f"{sweep_dir}: not a sweep directory (no {PLAN_FILE}; `tools/sweep.py run` writes it)")
    with open(path) as f:
        return json.load(f)


def print_plan(spec: SweepSpec, runs: Sequence[Run]) -> None:
    points = len({r.point for r in runs})
    seeds = f" x {len(spec.seeds)} seeds" if spec.seeds else ""
    print(f"sweep {spec.name}: {len(runs)} runs ({points} points{seeds}), backend "
          f"{spec.launch.get('backend', 'local')}, entry {spec.entry}, base {shown(spec.base)}")
    print(f"sweep dir: {spec.sweep_dir}")
    width = max(len(r.name) for r in runs)
    for r in runs:
        print(f"{r.index:>4}  {r.name:<{width}}  {r.launch.describe():<22}  {shown(r.run_dir)}")


def simulate_points(spec: SweepSpec, runs: Sequence[Run], profile: str) -> List[Tuple[str, Optional[float], str]]:
    """(point, predicted mean iteration ms or None, note) per point (its first seed: the simulator
    replays a synthetic trace, `simulate.trace` / `.seed`, not the training seed), fastest first."""
    import torch

    from megatron_moe.perf.hardware import load_profile
    from megatron_moe.sim.results import summarize
    from megatron_moe.sim.runner import simulate

    torch.set_num_threads(1)  # the planners' tensors are small (as tools/simulate.py)
    hardware = load_profile(profile)
    opts = spec.simulate
    firsts = {}
    for r in runs:
        firsts.setdefault(r.point, r)
    out = []
    with tempfile.TemporaryDirectory() as workdir:
        for i, (point, run) in enumerate(firsts.items()):
            try:
                results = simulate(spec.base, run.overrides, hardware, run.launch.world_size,
                                   opts.trace, opts.iterations, workdir, opts.seed)
                ms = summarize(results)["iteration_ms"]["mean"]
                out.append((point, ms, f"world {run.launch.world_size}"))
            except ConfigError as exc:
                out.append((point, None, f"not simulated: {exc}"))
            print(f"  simulated {i + 1}/{len(firsts)}: {point}", file=sys.stderr, flush=True)
    return sorted(out, key=lambda item: (item[1] is None, item[1] or 0.0))


def print_simulation(spec: SweepSpec, ranked: List[Tuple[str, Optional[float], str]], profile: str) -> None:
    opts = spec.simulate
    print(f"predicted iteration time (cluster simulator: {shown(profile)}, trace {opts.trace}, "
          f"{opts.iterations} iterations), fastest first:")
    width = max(len(p) for p, _, _ in ranked)
    for point, ms, note in ranked:
        cell = f"{ms:10.2f} ms" if ms is not None else f"{'-':>13}"
        print(f"  {cell}  {point:<{width}}  {note}")
    best = [p for p, ms, _ in ranked if ms is not None][: opts.top]
    if not best:
        raise ConfigError(f"--simulate: no point could be simulated ({ranked[0][2]})")
    print(f"recommended subset (the {len(best)} fastest, simulate.top={opts.top}):")
    only = " ".join(f"--only {p}" for p in best)
    print(f"  tools/sweep.py run {shown(spec.path)} {only}")
