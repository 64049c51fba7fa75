"""Training step time against the number of experts at a fixed amount of work (issue #16): the same
tokens and top-k, so the same expert FLOPs, with only `moe.num_experts` changed.

    python benchmarks/expert_scaling.py                       # 1 process
    python benchmarks/expert_scaling.py --nproc 2 --expert 2  # expert=2 on 2 processes (torchrun)

Each (E, repetition) is one training run of --config (default `configs/gpt_moe_tiny.yaml`) for
--iters iterations on the embedded data, with `moe.num_experts=E` and any further dotted
--override; runs alternate over E within each repetition, so load drifts hit every E alike. From
each run's metrics.jsonl (rank 0) the iterations after --warmup give the median step time and its
forward / backward / optimizer parts (`time_ms`). Per E: the median over repetitions, the ratio to
the smallest E, and rank 0's parameter count (expert parameters grow with E: the optimizer's share of a
step grows with them, the expert compute does not). Prints one JSON object.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/gpt_moe_tiny.yaml")
    p.add_argument("--experts", default="8,32,64,128,256", help="comma-separated moe.num_experts values")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3, help="first iterations left out of the median")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--nproc", type=int, default=1, help="processes (torchrun when > 1)")
    p.add_argument("--expert", type=int, default=1, help="parallel.expert")
    p.add_argument("--override", action="append", default=[], help="further dotted config overrides")
    args = p.parse_args(argv)
    args.experts = [int(e) for e in args.experts.split(",")]
    if args.warmup >= args.iters:
        p.error("--warmup must be below --iters")
    return args


def run(args, experts: int, run_dir: str) -> dict:
    """One training run -> {step, forward, backward, optimizer} median ms and the parameter count."""
    launcher = [sys.executable] if args.nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
    overrides = [f"moe.num_experts={experts}", f"parallel.expert={args.expert}", f"training.train_iters={args.iters}",
                 f"training.run_dir={run_dir}", "training.log_interval=1",
                 f"training.eval_interval={args.iters + 1}", *args.override]
    cmd = launcher + [os.path.join(ROOT, "pretrain_gpt_moe.py"), "--config", args.config, *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        raise SystemExit(f"E={experts}: training failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if '"iter_time_ms"' in line]
    timed = [r for r in records if r["iteration"] > args.warmup]
    med = statistics.median
    return {"step": med(r["iter_time_ms"] for r in timed),
            **{part: med(r["time_ms"][part] for r in timed) for part in ("forward", "backward", "optimizer")},
            "local_parameters": parameter_count(proc.stdout + proc.stderr)}


def parameter_count(log: str):
    """Rank 0's "N local parameters" from the trainer's start-up line (None if absent)."""
    match = re.search(r"([\d,]+) local parameters", log)
    return int(match.group(1).replace(",", "")) if match else None


def main(argv=None) -> int:
    args = parse_args(argv)
    samples = {e: [] for e in args.experts}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for e in args.experts:
                samples[e].append(run(args, e, os.path.join(tmp, f"e{e}-r{rep}")))
                print(f"rep {rep + 1}/{args.reps} E={e}: {samples[e][-1]['step']:.1f} ms/iter", file=sys.stderr,
                      flush=True)
    results = {}
    for e in args.experts:
        results[e] = {k: round(statistics.median(s[k] for s in samples[e]), 2)
                      for k in ("step", "forward", "backward", "optimizer")}
        results[e]["local_parameters"] = samples[e][0]["local_parameters"]
    smallest = results[min(args.experts)]
    for r in results.values():
        r["step_vs_smallest_E"] = round(r["step"] / smallest["step"], 3)
        r["forward_backward_vs_smallest_E"] = round((r["forward"] + r["backward"])
                                                    / (smallest["forward"] + smallest["backward"]), 3)
    print(json.dumps({"config": {k: v for k, v in vars(args).items()}, "results_ms": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
