"""bf16 against fp32 over a run of the demo config (issue #29): the loss curves of
`configs/gpt_moe_tiny.yaml` (what `make demo` trains, on the embedded corpus), one process, same
seed and data, `training.precision=fp32` and `bf16`; every iteration's training loss logged.

    python benchmarks/bf16_loss_curve.py                   # 300 iterations
    python benchmarks/bf16_loss_curve.py --iters 50 training.micro_batch_size=4

Reported: per precision the losses at a few iterations and the run time; over all iterations
the relative gap |bf16 - fp32| / fp32: `max_rel_gap` (and where), `mean_rel_gap`,
`iterations_over_1pct`; `max_rel_gap_smoothed`, the largest gap between the curves' running means
of --window iterations (what a loss plot shows), and `final_rel_gap` of the last window's means. Prints one JSON object (docs/precision.md keeps one).

`--noise` also trains fp32 again with another intra-op thread count (1, or 2 if the first run
had 1): only the order in which multi-threaded kernels accumulate differs. Its gaps to the first
fp32 run (`fp32_noise`) are what rounding alone does to the curve, the scale to read bf16's against.

`--seeds 1234,7,...` trains every precision once per seed (`training.seed`: the initial weights
and the data order) and reports each seed's gaps (`per_seed`) and, the issue's criterion, the gaps
between the curves averaged over the seeds (`seed_mean`; with `--noise` also `seed_mean_noise`).
One run's gap is one sample of how far two trajectories that round differently drift apart, which
has no sign; averaging over seeds cancels that drift and keeps what bf16 changes systematically.

    python benchmarks/bf16_loss_curve.py --noise --seeds 1234,7,1,2,3,4,5,6,8,9
"""
import argparse
import json
import sys
import tempfile

import torch

from megatron_moe.config import load_config
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.perf import timing
from megatron_moe.perf.machine import load_average, machine_info
from megatron_moe.training.trainer import Trainer


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="dotted config overrides of both runs")
    p.add_argument("--config", default="configs/gpt_moe_tiny.yaml")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--window", type=int, default=10, help="running-mean window of the smoothed gap")
    p.add_argument("--noise", action="store_true",
                   help="also fp32 with another thread count: the gap that rounding order alone makes")
    p.add_argument("--seeds", type=lambda text: [int(seed) for seed in text.split(",")], default=None,
                   help="comma-separated training.seed values: the gaps per seed and of the seed-averaged curves")
    return p.parse_args(argv)


def run(args, precision: str, tmp: str, name: str = ""):
    cfg = load_config(args.config, [f"training.train_iters={args.iters}", "training.log_interval=1",
                                    "training.eval_interval=0", "logging.tensorboard=false",
                                    f"training.run_dir={tmp}/{name or precision}", f"training.precision={precision}"]
                      + list(args.overrides))
    trainer = Trainer(cfg, ParallelState.single_process())
    with timing.wall() as took:
        records = trainer.train()
    return [r["loss"] for r in records], took.seconds


def running_mean(xs, window):
    return [sum(xs[max(0, i - window + 1): i + 1]) / len(xs[max(0, i - window + 1): i + 1]) for i in range(len(xs))]


def gap_stats(ref, other, window: int) -> dict:
    """Relative gaps |other - ref| / ref per iteration and of the `window`-iteration running means."""
    gaps = [abs(b - f) / f for f, b in zip(ref, other)]
    smooth_gaps = [abs(b - f) / f for f, b in zip(running_mean(ref, window), running_mean(other, window))]
    return {"max_rel_gap": round(max(gaps), 5), "max_rel_gap_iteration": gaps.index(max(gaps)) + 1,
            "mean_rel_gap": round(sum(gaps) / len(gaps), 5), "iterations_over_1pct": sum(g > 0.01 for g in gaps),
            "max_rel_gap_smoothed": round(max(smooth_gaps), 5), "final_rel_gap": round(smooth_gaps[-1], 5)}


def train_seed(args, tmp: str, seed=None) -> tuple:
    """({precision or "fp32_noise": losses}, {precision: seconds}) of one seed's runs (None: the
    config's seed), each in its own run directory."""
    overrides = [] if seed is None else [f"training.seed={seed}"]
    args = argparse.Namespace(**{**vars(args), "overrides": list(args.overrides) + overrides})
    tag = "" if seed is None else f"_seed{seed}"
    curves, seconds = {}, {}
    for precision in ("fp32", "bf16"):
        print(f"training {args.iters} iterations in {precision} {' '.join(overrides)}", file=sys.stderr, flush=True)
        curves[precision], seconds[precision] = run(args, precision, tmp, precision + tag)
    if args.noise:
        threads = torch.get_num_threads()
        torch.set_num_threads(1 if threads > 1 else 2)
        print(f"training {args.iters} iterations in fp32 on {torch.get_num_threads()} threads", file=sys.stderr,
              flush=True)
        curves["fp32_noise"], _ = run(args, "fp32", tmp, "fp32_noise" + tag)
        torch.set_num_threads(threads)
    return curves, seconds


def curve_report(curves: dict, window: int) -> dict:
    """The gaps of bf16 (and of fp32 on another thread count) to fp32."""
    out = gap_stats(curves["fp32"], curves["bf16"], window)
    if "fp32_noise" in curves:
        out["fp32_noise"] = gap_stats(curves["fp32"], curves["fp32_noise"], window)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    machine = machine_info()
    marks = sorted({1, 10, 50, 100, 200, args.iters} & set(range(1, args.iters + 1)))
    loss_at = lambda curves: {p: {str(i): round(c[i - 1], 4) for i in marks} for p, c in curves.items()}  # noqa: E731
    out = {"config": {"config": args.config, "iters": args.iters, "overrides": args.overrides, "window": args.window,
                      "seeds": args.seeds}}
    with tempfile.TemporaryDirectory() as tmp:
        if args.seeds is None:
            curves, seconds = train_seed(args, tmp)
            out.update(loss_at=loss_at(curves), seconds={p: round(t, 1) for p, t in seconds.items()},
                       **curve_report(curves, args.window))
        else:
            runs = [train_seed(args, tmp, seed) for seed in args.seeds]
            mean = {p: [sum(c) / len(c) for c in zip(*(curves[p] for curves, _ in runs))] for p in runs[0][0]}
            report = curve_report(mean, args.window)
            out.update(seed_mean={key: value for key, value in report.items() if key != "fp32_noise"},
                       loss_at_seed_mean=loss_at(mean),
                       per_seed=[{"seed": seed, "loss_at": loss_at(curves), **curve_report(curves, args.window)}
                                 for seed, (curves, _) in zip(args.seeds, runs)],
                       seconds={p: round(sum(seconds[p] for _, seconds in runs), 1) for p in runs[0][1]})
            if "fp32_noise" in report:
                out["seed_mean_noise"] = report["fp32_noise"]
    out["machine"] = dict(machine, load_average=[machine["load_average"], load_average()])
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
