"""Sweep files (docs/sweeps.md): parse and check one YAML file, expand it into runs.

    spec = load_sweep("configs/sweeps/balancers_ep2.yaml")
    runs = expand(spec)     # grid x zip groups x seeds (cartesian, in file order, seeds varying fastest)
    runs[0].name            # "balancer=none,schedule=baseline,num_experts=8,top_k=2,seed=1"
    runs[0].overrides       # the file's overrides + the run's keys + training.seed + its run directory

A run's name is built from its varied keys (the last part of each dotted key, the whole key where
two would clash) and values only, so it does not depend on the order runs are launched in, and a
rerun of the same file finds the same run directories: `<sweep_dir>/runs/<name>`. Keys under
`launch.` (nproc, nodes, ...) may vary too: they change the resources, not the config.
"""
from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from megatron_moe.config import ConfigError
from megatron_moe.sweep.launch_spec import SHAPE_KEYS, Launch, make_launch

ROOT = Path(__file__).resolve().parents[2]  # the checkout: entry points and scripts/ live here
TOP_KEYS = ("name", "base", "entry", "overrides", "grid", "zip", "seeds", "launch", "metrics", "report", "simulate",
            "sweep_dir")
DEFAULT_METRICS = ("loss", "eval_ppl", "tokens_per_sec", "iter_time_ms", "a2a_exposed_ms", "expert_load_imbalance")
SEED_KEY = "training.seed"
# set by the sweep for every run (its own directory, checkpoints there, resume from the newest)
RESERVED = ("training.run_dir", "checkpoint.dir", "checkpoint.load")


NO_GROUP = "none"  # report.group_by / --group-by: overlay every point, one panel per metric


@dataclass(frozen=True)
class ReportOptions:
    value: str = "final"  # final | mean (over the last `last_n` iterations)
    last_n: int = 10
    group_by: Optional[str] = None  # loss-curve panels by this key | none (overlay); None: none if one key varies


@dataclass(frozen=True)
class SimulateOptions:
    profile: Optional[str] = None  # hardware profile used when `plan --simulate` names none
    trace: str = "zipf:1.2"
    iterations: int = 20
    seed: int = 0
    top: int = 3  # the recommended subset: this many fastest points


@dataclass(frozen=True)
class Axis:
    """Keys varied together (one grid key, or one zip group) and their values, one tuple per position."""
    keys: Tuple[str, ...]
    values: Tuple[Tuple[Any, ...], ...]


@dataclass(frozen=True)
class SweepSpec:
    path: str
    name: str
    base: str  # absolute path of the model config
    entry: str  # relative to the checkout (scripts/run_local.sh and the sbatch scripts expect that)
    overrides: Tuple[str, ...]
    axes: Tuple[Axis, ...]
    seeds: Tuple[int, ...]
    launch: Dict[str, Any]  # the `launch` mapping as written (each run merges its own launch.* keys in)
    metrics: Tuple[str, ...]
    report: ReportOptions
    simulate: SimulateOptions
    sweep_dir: str  # absolute

    @property
    def varied_keys(self) -> List[str]:
        return [k for axis in self.axes for k in axis.keys] + ([SEED_KEY] if self.seeds else [])


@dataclass(frozen=True)
class Run:
    index: int  # 1-based position in the sweep
    name: str
    point: str  # the name without its seed: the seeds of one point aggregate in the report
    varied: Tuple[Tuple[str, Any], ...]  # (dotted key, value), file order
    config_overrides: Tuple[str, ...]  # the file's overrides and the run's config keys (not launch.*)
    launch: Launch
    run_dir: str

    @property
    def overrides(self) -> List[str]:
        """What the entry point gets: the config overrides and the run's own directory and checkpoints."""
        return list(self.config_overrides) + [f"training.run_dir={self.run_dir}",
                                              f"checkpoint.dir={os.path.join(self.run_dir, 'checkpoints')}",
                                              "checkpoint.load=auto"]

    @property
    def seed(self) -> Optional[int]:
        return dict(self.varied).get(SEED_KEY)


def shown(path: str) -> str:
    """A path as printed: relative to the current directory when inside it, else absolute."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def format_value(value: Any) -> str:
    """A YAML value as the right-hand side of an OmegaConf dotlist override."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, dict)):
        return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return str(value)


def _label_value(value: Any) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", format_value(value)).strip("_") or "_"


def _mapping(value: Any, where: str, known: Sequence[str]) -> Dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(value).__name__}")
    unknown = [k for k in value if k not in known]
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(known)})")
    return value


def _values(value: Any, where: str) -> List[Any]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where} must be a non-empty list of values, got {value!r}")
    return value


def _key(key: Any, where: str) -> str:
    if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)+", key):
        raise ConfigError(f"{where}: {key!r} is not a dotted config key (section.key) or launch.<key>")
    if key in RESERVED:
        raise ConfigError(f"{where}: {key} is set by the sweep (each run: <sweep_dir>/runs/<name>, "
                          "checkpoints there, checkpoint.load=auto)")
    if key.startswith("launch.") and key.split(".", 1)[1] not in SHAPE_KEYS:
        raise ConfigError(f"{where}: {key} cannot vary per run (launch keys that can: {', '.join(SHAPE_KEYS)})")
    return key


def _axes(grid: Any, zips: Any) -> List[Axis]:
    if grid is not None and not isinstance(grid, dict):
        raise ConfigError(f"grid must be a mapping {{key: [values]}}, got {type(grid).__name__}")
    axes = [Axis((_key(k, "grid"),), tuple((v,) for v in _values(vals, f"grid.{k}"))) for k, vals in (grid or {}).items()]
    if zips is not None and not isinstance(zips, list):
        raise ConfigError(f"zip must be a list of mappings {{key: [values]}}, got {type(zips).__name__}")
    for i, group in enumerate(zips or []):
        if not isinstance(group, dict) or not group:
            raise ConfigError(f"zip[{i}] must be a non-empty mapping {{key: [values]}}")
        keys = tuple(_key(k, f"zip[{i}]") for k in group)
        lists = [_values(group[k], f"zip[{i}].{k}") for k in keys]
        if len({len(v) for v in lists}) > 1:
            raise ConfigError(f"zip[{i}]: the lists vary together and must have one length, got "
                              + ", ".join(f"{k}: {len(v)}" for k, v in zip(keys, lists)))
        axes.append(Axis(keys, tuple(zip(*lists))))
    keys = [k for axis in axes for k in axis.keys]
    twice = [k for k in keys if keys.count(k) > 1]
    if twice:
        raise ConfigError(f"{twice[0]} is varied twice (grid and zip, or two zip groups): vary each key in one place")
    return axes


def _existing(path: str, where: str) -> str:
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise ConfigError(f"{where}: {path}: no such file (relative paths are relative to {os.getcwd()})")
    return full


def load_sweep(path: str, sweep_dir: Optional[str] = None) -> SweepSpec:
    """Read and check a sweep file (one-line `ConfigError` naming the key on a bad one)."""
    if not os.path.isfile(path):
        raise ConfigError(f"sweep file {path}: no such file")
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"sweep file {path}: {str(exc).splitlines()[0]}") from None
    raw = _mapping(raw, f"sweep file {path}", TOP_KEYS)
    if "base" not in raw:
        raise ConfigError(f"sweep file {path}: 'base' (the model config the runs start from) is required")
    entry = str(raw.get("entry", "pretrain_gpt_moe.py"))
    if os.path.isabs(entry) or not (ROOT / entry).is_file():
        raise ConfigError(f"entry: {entry} is not an entry point of the checkout {ROOT} (e.g. pretrain_gpt_moe.py)")
    overrides = raw.get("overrides") or []
    if not isinstance(overrides, list) or not all(isinstance(o, str) and "=" in o for o in overrides):
        raise ConfigError(f"overrides must be a list of section.key=value strings, got {overrides!r}")
    for item in overrides:
        if _key(item.split("=", 1)[0].strip(), "overrides").startswith("launch."):
            raise ConfigError(f"overrides: {item} is not a config override (resources go in the launch block)")
    seeds = raw.get("seeds") or []
    if not isinstance(seeds, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        raise ConfigError(f"seeds must be a list of integers, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"seeds: {seeds} repeats a seed")
    axes = _axes(raw.get("grid"), raw.get("zip"))
    if seeds and any(SEED_KEY in a.keys for a in axes):
        raise ConfigError(f"{SEED_KEY} is varied by both 'seeds' and grid/zip: use one")
    launch = dict(_mapping(raw.get("launch"), "launch", ("backend", "max_parallel", "signal_delay_s", "sbatch")
                           + SHAPE_KEYS))
    make_launch(launch, "launch")  # the file's own launch block is valid on its own
    metrics = raw.get("metrics", list(DEFAULT_METRICS))
    if not isinstance(metrics, list) or not metrics or not all(isinstance(m, str) for m in metrics):
        raise ConfigError(f"metrics must be a non-empty list of metrics.jsonl field names, got {metrics!r}")
    report = ReportOptions(**_mapping(raw.get("report"), "report", ("value", "last_n", "group_by")))
    check_report(report, [k for a in axes for k in a.keys])
    simulate = SimulateOptions(**_mapping(raw.get("simulate"), "simulate",
                                          ("profile", "trace", "iterations", "seed", "top")))
    if not (isinstance(simulate.iterations, int) and simulate.iterations > 0 and isinstance(simulate.top, int)
            and simulate.top > 0):
        raise ConfigError("simulate.iterations and simulate.top must be positive integers")
    name = str(raw.get("name") or Path(path).stem)
    if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise ConfigError(f"name: {name!r} may hold letters, digits and . _ - only")
    return SweepSpec(path=os.path.abspath(path), name=name, base=_existing(str(raw["base"]), "base"), entry=entry,
                     overrides=tuple(overrides), axes=tuple(axes), seeds=tuple(seeds), launch=launch,
                     metrics=tuple(metrics), report=report, simulate=simulate,
                     sweep_dir=os.path.abspath(sweep_dir or raw.get("sweep_dir") or os.path.join("runs", "sweeps", name)))


def check_report(report: ReportOptions, keys: Sequence[str]) -> None:
    if report.value not in ("final", "mean"):
        raise ConfigError(f"report.value={report.value} is not one of final | mean")
    if not isinstance(report.last_n, int) or report.last_n < 1:
        raise ConfigError(f"report.last_n={report.last_n} must be a positive integer")
    if report.group_by not in (None, NO_GROUP, *keys):
        raise ConfigError(f"report.group_by={report.group_by} is not a varied key (varied: "
                          f"{', '.join(keys) or 'none'}) or {NO_GROUP} (every point in one panel per metric)")


def _labels(keys: Sequence[str]) -> Dict[str, str]:
    """Short label per key: its last part, the whole key where two keys end alike."""
    leaf = {k: ("seed" if k == SEED_KEY else k.rsplit(".", 1)[-1]) for k in keys}
    clash = {v for v in leaf.values() if list(leaf.values()).count(v) > 1}
    return {k: (k if leaf[k] in clash else leaf[k]) for k in keys}


def expand(spec: SweepSpec) -> List[Run]:
    """Every run of the sweep, in order; a point whose launch keys are impossible raises naming it."""
    axes = list(spec.axes) + ([Axis((SEED_KEY,), tuple((s,) for s in spec.seeds))] if spec.seeds else [])
    labels = _labels([k for a in axes for k in a.keys])
    runs: List[Run] = []
    for combo in itertools.product(*(a.values for a in axes)):
        varied = tuple((k, v) for axis, values in zip(axes, combo) for k, v in zip(axis.keys, values))
        parts = [f"{labels[k]}={_label_value(v)}" for k, v in varied]
        name = ",".join(parts) or "run"
        point = ",".join(p for (k, _), p in zip(varied, parts) if k != SEED_KEY) or "run"
        launch_keys = {k.split(".", 1)[1]: v for k, v in varied if k.startswith("launch.")}
        try:
            launch = make_launch({**spec.launch, **launch_keys})
        except ConfigError as exc:
            raise ConfigError(f"run {name!r}: {exc}") from None
        config = tuple(spec.overrides) + tuple(f"{k}={format_value(v)}" for k, v in varied
                                               if not k.startswith("launch."))
        runs.append(Run(len(runs) + 1, name, point, varied, config, launch,
                        os.path.join(spec.sweep_dir, "runs", name)))
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ConfigError(f"two runs would share the name {dup!r} (values that differ only in characters "
                          "a directory name cannot hold): change one value")
    return runs


def select(runs: List[Run], only: Sequence[str]) -> List[Run]:
    """The runs named in `only` (run names, or point names: every seed of the point)."""
    if not only:
        return runs
    known = {r.name for r in runs} | {r.point for r in runs}
    missing = [o for o in only if o not in known]
    if missing:
        raise ConfigError(f"--only {missing[0]}: no run or point of this sweep has that name (see `plan`)")
    return [r for r in runs if r.name in only or r.point in only]
