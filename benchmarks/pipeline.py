"""Pipeline bubble and optimizer memory (issue #14), side by side in one run.

    python benchmarks/pipeline.py                                   # 2 stages, m = 2, 4, 8
    python benchmarks/pipeline.py --stages 2 --micro-batches 2,4,8 --memory-nproc 4

Bubble rows: the real entry point (`pretrain_gpt_moe.py` under torchrun) on --stages processes,
one pipeline stage each (data parallel 1), for every m in --micro-batches (m = global batch /
micro batch) with `1f1b` and with `interleaved` over --virtual chunks per stage. Each iteration
logs `pipeline_bubble` (training/trainer.py: per rank 1 - forward/backward compute time / the slowest
stage's schedule time, averaged over the ranks); a row reports the median over the iterations
after --warmup (`bubble_measured`) next to

* `bubble_ideal`: (p - 1) / (v m + p - 1), equal stages, free messages (Narayanan et al. §2.2;
  `simulate` in training/pipeline_schedules.py gives exactly this for the programs that run);
* `bubble_simulated`: the same programs simulated with each stage's measured compute time per
  chunk step (`pipeline_compute_ms` / (v m)): the bubble of these unequal stages (the first holds
  the embedding, the last the output layer and the loss) with free messages. measured - simulated
  is what the runtime adds: point-to-point latency and the schedule's own Python time;
* `bubble_predicted`: what the cluster simulator (megatron_moe/sim/, docs/simulator.md) predicts
  for the same config from a hardware profile alone (--profile: this machine's fitted costs),
  replaying the run's routing trace: no measured time goes in;

and the median step time.

Memory rows: --memory-nproc processes, pipeline=2 and data parallel = nproc / 2, with
`optimizer.distributed` false and true: the optimizer state per rank (`optimizer_state_mb`,
AdamW's moments: exact, machine-independent) and the peak resident set size (`max_rss_mb`).

Prints one line per row, then one JSON object on the last line.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_moe.config import load_config  # noqa: E402
from megatron_moe.perf.hardware import load_profile  # noqa: E402
from megatron_moe.sim.runner import Simulation  # noqa: E402
from megatron_moe.training.pipeline_schedules import programs, simulate  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["model.num_layers=8", "model.hidden_size=256", "model.ffn_hidden_size=1024", "model.num_attention_heads=4",
         "model.seq_length=128", "moe.num_experts=4", "moe.expert_ffn_hidden_size=512", "moe.layer_freq=2",
         "training.micro_batch_size=2", "logging.tensorboard=false", "optimizer.warmup_iters=1"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/gpt_moe_tiny.yaml")
    p.add_argument("--stages", type=int, default=2, help="parallel.pipeline for the bubble rows (= processes)")
    p.add_argument("--virtual", type=int, default=2, help="parallel.virtual_stages of the interleaved rows")
    p.add_argument("--micro-batches", default="2,4,8",
                   help="comma-separated micro-batches per iteration ('' = no bubble rows)")
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="first iterations left out of the medians")
    p.add_argument("--memory-nproc", type=int, default=4, help="processes of the memory rows (0 = no memory rows)")
    p.add_argument("--override", action="append", default=[], help="further dotted config overrides")
    p.add_argument("--profile", default="configs/hardware/cpu_gloo_2proc.yaml",
                   help="hardware profile of the simulator's bubble_predicted")
    args = p.parse_args(argv)
    args.micro_batches = [int(m) for m in args.micro_batches.split(",") if m]
    if args.warmup >= args.iters:
        p.error("--warmup must be below --iters")
    return args


def train(args, nproc: int, overrides, run_dir: str) -> list:
    """One training run on `nproc` processes -> its metrics.jsonl records (rank 0's)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(ROOT, "pretrain_gpt_moe.py"), "--config", args.config, *MODEL,
           f"training.train_iters={args.iters}", "training.log_interval=1", f"training.eval_interval={args.iters + 1}",
           f"training.run_dir={run_dir}", *overrides, *args.override]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(overrides)}: training failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "iter_time_ms" in r]


def predicted_bubble(args, overrides, run_dir: str) -> float:
    """The cluster simulator's median bubble over the run's iterations after --warmup, on its routing trace."""
    cfg = load_config(os.path.join(ROOT, args.config), MODEL + overrides + args.override)
    with tempfile.TemporaryDirectory() as work:
        sim = Simulation(cfg, load_profile(os.path.join(ROOT, args.profile)), args.stages, work)
        results = sim.run(sim.trace(os.path.join(run_dir, "routing"), 0).steps())
    return statistics.median(r.pipeline_bubble for r in results[args.warmup:])


def bubble_rows(args, tmp: str) -> list:
    rows = []
    schedules = [("1f1b", 1), ("interleaved", args.virtual)]
    for m in args.micro_batches:
        for schedule, virtual in schedules:
            if virtual > 1 and m % args.stages:
                continue  # interleaving needs m divisible by the stages
            overrides = [f"parallel.pipeline={args.stages}", f"parallel.pipeline_schedule={schedule}",
                         f"parallel.virtual_stages={virtual}", f"training.global_batch_size={2 * m}",
                         "logging.routing_trace=true"]
            run_dir = os.path.join(tmp, f"{schedule}-{m}")
            records = train(args, args.stages, overrides, run_dir)[args.warmup:]
            progs = programs(schedule, args.stages, m, virtual)
            simulated = [simulate(progs, virtual, *zip(*[[ms / (m * virtual) for ms in r["pipeline_compute_ms"][f"rank{s}"]]
                                                          for s in range(args.stages)])).mean_bubble for r in records]
            row = {"schedule": schedule, "stages": args.stages, "virtual_stages": virtual, "micro_batches": m,
                   "bubble_measured": round(statistics.median(r["pipeline_bubble"] for r in records), 4),
                   "bubble_simulated": round(statistics.median(simulated), 4),
                   "bubble_predicted": round(predicted_bubble(args, overrides, run_dir), 4),
                   "bubble_ideal": round(records[0]["pipeline_bubble_ideal"], 4),
                   "step_ms": round(statistics.median(r["iter_time_ms"] for r in records), 1),
                   "pipeline_bytes_rank0": records[0]["comm_bytes"].get("pipeline", 0)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def memory_rows(args, tmp: str) -> list:
    rows = []
    for distributed in (False, True):
        overrides = ["parallel.pipeline=2", f"optimizer.distributed={str(distributed).lower()}",
                     f"training.global_batch_size={2 * args.memory_nproc}"]
        last = train(args, args.memory_nproc, overrides, os.path.join(tmp, f"memory-{distributed}"))[-1]
        row = {"optimizer.distributed": distributed, "nproc": args.memory_nproc, "pipeline": 2,
               "optimizer_state_mb": last["optimizer_state_mb"], "max_rss_mb": last["max_rss_mb"]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main(argv=None) -> dict:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = {"bubble": bubble_rows(args, tmp),
                  "memory": memory_rows(args, tmp) if args.memory_nproc else []}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
