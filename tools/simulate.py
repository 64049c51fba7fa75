"""Predict MoE training time on a cluster from a routing trace, for several options side by side.

    python tools/simulate.py --config configs/papers/flexmoe_gpt_moe_s.yaml parallel.expert=32 \
        --hardware configs/hardware/flexmoe_azure_a100.yaml --gpus 32 --trace drift:1.0:0.05 \
        --iterations 100 --option moe.balancer=none --option moe.balancer=flexmoe --out runs/sim
    python tools/simulate.py ... --trace runs/my_run/routing          # replay a recorded trace
    python tools/simulate.py ... --recommend                          # rank every option combination
    python tools/simulate.py ... --recommend --option ... --option ...  # rank just these
    python tools/simulate.py ... --recommend --option parallel.pipeline=1 --option parallel.pipeline=2 \
        --option "parallel.pipeline=2 parallel.pipeline_schedule=interleaved parallel.virtual_stages=2"

Each --option is one combination of config overrides (space- or comma-separated) applied on top of
the config and its overrides; without --option the config runs as is. Per option: the predicted
iteration time, its breakdown (compute, each collective, Trans / Agg, exposed vs hidden) on the
critical rank, per MoE layer time, balance ratio and replicas, and with pipeline stages the
predicted bubble next to the ideal (p - 1) / (v m + p - 1). Writes <out>/summary.json (and
per-iteration details in <out>/<option>.json) and PNG plots; prints one JSON object on its last
line. --recommend ranks the --option combinations (default: every one of
`megatron_moe.sim.results.candidate_options()`; with parallel.tensor=1 the baseline schedule only)
and prints the overrides of the fastest.
docs/simulator.md has the model and every knob.
"""
import argparse
import json
import re
import sys
import tempfile

import torch

from megatron_moe.config import ConfigError, load_config
from megatron_moe.perf import timing
from megatron_moe.perf.hardware import load_profile
from megatron_moe.sim.results import candidate_options, plot, summarize, write_json
from megatron_moe.sim.runner import simulate


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="config overrides section.key=value")
    p.add_argument("--config", default=None, help="model config YAML (as for training)")
    p.add_argument("--hardware", required=True, help="hardware profile YAML (configs/hardware/)")
    p.add_argument("--gpus", type=int, required=True, help="simulated world size")
    p.add_argument("--trace", default="zipf:1.2", help="routing trace directory, or uniform | zipf:S | drift:S:D")
    p.add_argument("--iterations", type=int, default=100, help="iterations to simulate (a recorded trace: at most)")
    p.add_argument("--seed", type=int, default=0, help="seed of a synthetic trace")
    p.add_argument("--option", action="append", default=[], help="one option combination: overrides")
    p.add_argument("--recommend", action="store_true",
                   help="rank the options (default: every combination), print the best one's overrides")
    p.add_argument("--top", type=int, default=10, help="--recommend: combinations to print")
    p.add_argument("--out", default=None, help="directory for summary.json and the PNG plots")
    return p.parse_args(argv)


def option_name(option) -> str:
    return ",".join(option) if option else "config"


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # the planners' tensors are small: more threads only contend for the cores
    options = [re.split(r"[ ,]+", o.strip()) for o in args.option]
    if not options and args.recommend:
        tensor = load_config(args.config, args.overrides).parallel.tensor
        options = candidate_options(tensor)
        if tensor == 1:
            print("parallel.tensor=1: Parm's S1, S2 and auto run the baseline's communication, ranking the baseline "
                  "schedule only", flush=True)
    options = options or [[]]
    runs, skipped = {}, {}
    profile = load_profile(args.hardware)
    with tempfile.TemporaryDirectory() as workdir:
        for i, option in enumerate(options):
            name = option_name(option)
            watch = timing.Stopwatch()  # host work: the simulator
            try:
                runs[name] = simulate(args.config, list(args.overrides) + option, profile, args.gpus, args.trace,
                                      args.iterations, workdir, args.seed)
            except ConfigError as exc:
                skipped[name] = str(exc)
                print(f"[{i + 1}/{len(options)}] {name}: skipped ({exc})", flush=True)
                continue
            s = summarize(runs[name])
            bubble = f", pipeline bubble {s['pipeline_bubble']:.3f} (ideal {s['pipeline_bubble_ideal']:.3f})" \
                if s["pipeline_bubble_ideal"] else ""
            print(f"[{i + 1}/{len(options)}] {name}: {s['iteration_ms']['mean']:.2f} ms/iteration, MoE layers "
                  f"{sum(s['moe_layer_ms']):.2f} ms, balance {max(s['balance_ratio'], default=1):.2f}{bubble} "
                  f"({watch.seconds():.1f} s)", flush=True)
    if not runs:
        print(f"simulate.py: no option could run: {skipped}", file=sys.stderr)
        return 2
    summaries = {name: summarize(results) for name, results in runs.items()}
    ranked = sorted(summaries, key=lambda n: summaries[n]["iteration_ms"]["mean"])
    out = {"config": args.config, "overrides": args.overrides, "hardware": args.hardware, "gpus": args.gpus,
           "trace": args.trace, "options": summaries, "skipped": skipped, "ranking": ranked}
    if args.recommend:
        best = ranked[0]
        print("ranking (predicted mean iteration time):")
        for name in ranked[: args.top]:
            print(f"  {summaries[name]['iteration_ms']['mean']:10.2f} ms  {name}")
        print(f"recommended overrides: {' '.join(best.split(','))}")
        out["recommended"] = best.split(",")
    if args.out:
        write_json(f"{args.out}/summary.json", out)
        for name, results in runs.items():
            write_json(f"{args.out}/{re.sub(r'[^A-Za-z0-9_.=-]+', '_', name)}.json",
                       [{"iteration": r.iteration, "ms": r.seconds * 1e3,
                         "breakdown_ms": {k: [v[0] * 1e3, v[1] * 1e3] for k, v in r.breakdown.items()},
                         "layers": [{"ms": layer.seconds * 1e3, "balance_ratio": layer.balance_ratio,
                                     "replicas": layer.replicas, "schedules": layer.schedules} for layer in r.layers],
                         "pipeline_bubble": r.pipeline_bubble, "bytes": r.bytes_by_kind} for r in results])
        out["plots"] = plot(runs if not args.recommend else {n: runs[n] for n in ranked[: args.top]}, args.out)
    print(json.dumps({k: v for k, v in out.items() if k != "options"} | {"summary": {
        n: {"iteration_ms": summaries[n]["iteration_ms"]["mean"], "balance_ratio": summaries[n]["balance_ratio"],
            "pipeline_bubble": summaries[n]["pipeline_bubble"]} for n in ranked}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
