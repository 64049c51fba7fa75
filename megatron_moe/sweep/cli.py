"""`tools/sweep.py` / `python -m megatron_moe.sweep`: plan | run | status | report (docs/sweeps.md).

    tools/sweep.py plan configs/sweeps/balancers_ep2.yaml [--simulate configs/hardware/X.yaml]
    tools/sweep.py run configs/sweeps/balancers_ep2.yaml [--only NAME ...] [--no-wait]
    tools/sweep.py status configs/sweeps/balancers_ep2.yaml      # or the sweep directory
    tools/sweep.py report runs/sweeps/balancers_ep2 [--group-by moe.schedule | --group-by none]

Exit codes: 0 ok; 1 some run failed (or is unfinished); 2 a bad sweep file or run (one line
`sweep error: ...` per problem, nothing launched); 130 `run` stopped by Ctrl-C / SIGTERM.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from megatron_moe.config import ConfigError
from megatron_moe.sweep.plan import check_runs, print_plan, print_simulation, read_plan, simulate_points, write_plan
from megatron_moe.sweep.spec import SEED_KEY, ReportOptions, Run, check_report, expand, load_sweep, select, shown
from megatron_moe.sweep.state import Announcer, read_state, run_status, status_table
from megatron_moe.training.completion import read_complete_marker

SWEEP_ERROR_EXIT = 2


class SweepErrors(Exception):
    """Several one-line user errors (one per bad run), printed one per line."""

    def __init__(self, lines: List[str]):
        super().__init__("\n".join(lines))
        self.lines = lines


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tools/sweep.py", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="expand the grid, check every run with --check-config, optionally simulate")
    run = sub.add_parser("run", help="check, then run what is not finished (resuming from checkpoints)")
    for s in (plan, run):
        s.add_argument("sweep", help="the sweep file (configs/sweeps/*.yaml)")
        s.add_argument("--sweep-dir", default=None, help="where the runs go (default: the file's sweep_dir, "
                                                         "else runs/sweeps/<name>)")
        s.add_argument("--only", action="append", default=[], metavar="NAME",
                       help="only this run or point (all its seeds); repeatable")
    plan.add_argument("--simulate", nargs="?", const="", default=None, metavar="PROFILE",
                      help="rank the points with the cluster simulator on this hardware profile "
                           "(configs/hardware/; default: the file's simulate.profile)")
    run.add_argument("--no-wait", action="store_true", help="slurm: return after submitting (see `status`)")
    run.add_argument("--poll", type=float, default=10.0, help="slurm: seconds between queue checks (default 10)")
    for name, text in (("status", "a table of every run: state, iteration, ETA"),
                       ("report", "results.csv / .md, plots and TensorBoard HParams in the sweep directory")):
        s = sub.add_parser(name, help=text)
        s.add_argument("sweep", help="the sweep directory (or the sweep file)")
        s.add_argument("--sweep-dir", default=None, help="with a sweep file: its directory, if not the default")
    report = sub.choices["report"]
    report.add_argument("--group-by", default=None, metavar="KEY|none",
                        help="loss-curve panels by this varied key; none: every point in one panel per metric "
                             "(default: none when one key varies, else the first key)")
    report.add_argument("--value", choices=("final", "mean"), default=None, help="override report.value")
    report.add_argument("--last-n", type=int, default=None, help="override report.last_n")
    return p.parse_args(argv)


def planned(args) -> tuple:
    """(spec, every run, the runs --only selects) of a sweep whose runs all pass --check-config
    (else SweepErrors: one line per bad run)."""
    spec = load_sweep(args.sweep, args.sweep_dir)
    runs = expand(spec)
    selected = select(runs, args.only)
    errors = check_runs(spec, runs)
    if errors:
        raise SweepErrors(errors)
    return spec, runs, selected


def cmd_plan(args) -> int:
    spec, everything, runs = planned(args)
    print_plan(spec, runs)
    print(f"all {len(everything)} runs pass `{spec.entry} --check-config --world-size N`")
    if args.simulate is not None:
        profile = args.simulate or spec.simulate.profile
        if not profile:
            raise ConfigError("--simulate needs a hardware profile (configs/hardware/*.yaml) or simulate.profile")
        print_simulation(spec, simulate_points(spec, runs, profile), profile)
    return 0


def _changed(run: Run) -> Optional[str]:
    before = read_state(run.run_dir).get("overrides")
    if before is not None and before != run.overrides:
        return (f"run {run.name!r}: {run.run_dir} was launched with other overrides ({' '.join(before)}): "
                "the sweep file changed; use another --sweep-dir or delete that directory")
    return None


def cmd_run(args) -> int:
    spec, everything, runs = planned(args)
    changed = [e for r in runs if (e := _changed(r))]
    if changed:
        raise SweepErrors(changed)
    backend = spec.launch.get("backend", "local")
    if backend == "slurm":
        from megatron_moe.sweep.slurm import require_submitit

        require_submitit()  # the SLURM commands and submitit are there, before anything is written
    plan = write_plan(spec, everything)  # status and report cover the whole sweep, --only or not
    iters = {r["name"]: r["train_iters"] for r in plan["runs"]}
    done = [r for r in runs if read_complete_marker(r.run_dir) is not None]
    announce = Announcer(len(everything))
    for r in done:
        announce.last[r.name] = "done"
    chosen = f" ({len(runs)} chosen by --only)" if args.only else ""
    print(f"sweep {spec.name}: {len(everything)} runs{chosen}, {len(done)} finished before (skipped), "
          f"backend {backend}, dir {shown(spec.sweep_dir)}", flush=True)
    todo = [r for r in runs if r not in done]
    if backend == "local":
        from megatron_moe.sweep.local import run_local

        code = run_local(spec, todo, announce)
    else:
        from megatron_moe.sweep.slurm import run_slurm

        code = run_slurm(spec, todo, iters, announce, args.no_wait, args.poll)
        if args.no_wait:
            print(f"submitted; follow with: tools/sweep.py status {shown(spec.sweep_dir)}")
            return code
    print(status_of(spec.sweep_dir), flush=True)
    return code


def status_of(sweep_dir: str) -> str:
    plan = read_plan(sweep_dir)
    queue = None
    if plan["backend"] == "slurm":
        from megatron_moe.sweep.slurm import squeue_states

        queue = squeue_states([j for r in plan["runs"] if (j := read_state(r["run_dir"]).get("job"))])
    return status_table([(r["index"], r["name"], r["train_iters"], run_status(r["run_dir"], r["train_iters"], queue))
                         for r in plan["runs"]])


def sweep_dir_of(args) -> str:
    if os.path.isdir(args.sweep):
        return args.sweep
    return load_sweep(args.sweep, args.sweep_dir).sweep_dir


def cmd_status(args) -> int:
    print(status_of(sweep_dir_of(args)))
    return 0


def cmd_report(args) -> int:
    from megatron_moe.sweep.plots import write_report

    sweep_dir = sweep_dir_of(args)
    plan = read_plan(sweep_dir)
    opts = plan["report"]
    check_report(ReportOptions(args.value or opts["value"], opts["last_n"] if args.last_n is None else args.last_n,
                               args.group_by), [k for k in plan["varied_keys"] if k != SEED_KEY])
    for path in write_report(sweep_dir, plan, args.group_by, args.value, args.last_n):
        print(f"wrote {shown(path)}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    try:
        return {"plan": cmd_plan, "run": cmd_run, "status": cmd_status, "report": cmd_report}[args.command](args)
    except SweepErrors as exc:
        lines = exc.lines
    except ConfigError as exc:
        lines = [str(exc)]
    for line in lines:
        print(f"sweep error: {line}", file=sys.stderr)
    return SWEEP_ERROR_EXIT
