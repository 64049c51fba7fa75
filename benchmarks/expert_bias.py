"""Aux-loss-free balancing (`moe.expert_bias`, DeepSeek-V3 §2.1.2) against the aux loss on the demo
config with Zipf-skewed routing (issue #31): three runs of `configs/gpt_moe_tiny.yaml` on the
embedded corpus, same seed, data and layout, one after the other:

* `aux`: the config as shipped (load-balancing loss `moe.aux_loss_coeff` 0.01, no bias);
* `bias`: `moe.expert_bias=true`, `moe.aux_loss_coeff=0`, bias rate `--rate`;
* `neither`: no bias, `moe.aux_loss_coeff=0`.

The skew: every router's logits get the fixed offset -s * log(e) for expert e = 1..E (`--skew` s;
the routers' `logit_bias` measurement hook, as benchmarks/moe_layer.py --skew), so the initial
routing follows a Zipf law and stays skewed unless something balances it: the router weights
learning to cancel it (pushed by the aux loss) or the expert bias. `expert_load_imbalance` is
max / mean of the assignments per EP rank, so the runs use expert parallelism (`--expert`, =
the number of processes: every rank an EP rank; with E = 8 experts on 8 ranks it is max / mean
over experts).

    torchrun --nproc_per_node 4 benchmarks/expert_bias.py --expert 4            # 200 iterations
    torchrun --nproc_per_node 8 benchmarks/expert_bias.py --expert 8 --iters 400 --rate 0.003

Reported (rank 0, one JSON object): per run `expert_load_imbalance` (mean over MoE layers) over
the first and last `--window` iterations, the same for `balance_degree` (std of the per-expert
load), the loss (means of the first / last window), the run's wall time; over the loss curves'
running means of `--window` iterations the largest relative gap of `bias` and of `neither` to `aux`
(and where), and `aux_noise`: the relative std of the `aux` run's per-iteration loss around its
running mean over the second half (the iteration-to-iteration noise of one curve).
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

import torch

from bf16_loss_curve import running_mean
from megatron_moe.config import load_config
from megatron_moe.perf import timing
from megatron_moe.perf.machine import load_average, machine_info
from megatron_moe.distributed.rank_timing import init_state
from megatron_moe.training.trainer import Trainer

RUNS = {"aux": [], "bias": ["moe.expert_bias=true", "moe.aux_loss_coeff=0.0"], "neither": ["moe.aux_loss_coeff=0.0"]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="dotted config overrides of every run")
    p.add_argument("--config", default="configs/gpt_moe_tiny.yaml")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--expert", type=int, default=None, help="parallel.expert (default: the number of processes)")
    p.add_argument("--rate", type=float, default=1e-2, help="moe.expert_bias_rate of the bias run")
    p.add_argument("--skew", type=float, default=1.5, help="Zipf exponent s of the routers' logit offset -s log(e)")
    p.add_argument("--window", type=int, default=10, help="iterations of the first / last means and running means")
    return p.parse_args(argv)


def run(args, state, name: str, tmp: str):
    """One run; its per-iteration records from metrics.jsonl (rank 0) and its wall seconds."""
    run_dir = os.path.join(tmp, name)
    cfg = load_config(args.config, [f"training.train_iters={args.iters}", "training.log_interval=1",
                                    "training.eval_interval=0", "logging.tensorboard=false", "checkpoint.save_interval=0",
                                    f"parallel.expert={args.expert or state.world_size}", f"training.run_dir={run_dir}",
                                    f"moe.expert_bias_rate={args.rate}"] + RUNS[name] + list(args.overrides))
    trainer = Trainer(cfg, state)
    skew = -args.skew * torch.log(torch.arange(1, cfg.moe.num_experts + 1, dtype=torch.float32))
    for layer in trainer.model.moe_layers():
        layer.router.logit_bias = skew
    with timing.wall() as took:
        trainer.train()
    if state.rank != 0:
        return None, took.seconds
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f], took.seconds


def summary(records, window: int) -> dict:
    def mean_over_layers(key):
        return [sum(r[key]) / len(r[key]) for r in records]

    out = {}
    for key in ("expert_load_imbalance", "balance_degree"):
        values = mean_over_layers(key)
        out[key] = {"first": round(statistics.mean(values[:window]), 4), "last": round(statistics.mean(values[-window:]), 4)}
    loss = [r["loss"] for r in records]
    out["loss"] = {"first": round(statistics.mean(loss[:window]), 4), "last": round(statistics.mean(loss[-window:]), 4)}
    out["final_aux_loss"] = round(statistics.mean(r["aux_loss"] for r in records[-window:]), 5)
    return out


def max_gap(curve, ref):
    gaps = [abs(c - r) / r for c, r in zip(curve, ref)]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    return {"max_rel_gap": round(gaps[worst], 5), "at_iteration": worst + 1, "final_rel_gap": round(gaps[-1], 5)}


def main(argv=None) -> int:
    args = parse_args(argv)
    state = init_state(1, args.expert or int(os.environ.get("WORLD_SIZE", "1")), 1)
    if state.ep_size < 2:
        print("expert_load_imbalance is max / mean over EP ranks: run with --expert >= 2 "
              "(torchrun --nproc_per_node N benchmarks/expert_bias.py --expert N)", file=sys.stderr)
        return 2
    machine = machine_info()
    records, seconds = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in RUNS:
            if state.rank == 0:
                print(f"run {name}: {args.iters} iterations on expert={state.ep_size}", file=sys.stderr, flush=True)
            records[name], seconds[name] = run(args, state, name, tmp)
    if state.rank != 0:
        return 0
    curves = {name: running_mean([r["loss"] for r in recs], args.window) for name, recs in records.items()}
    aux_loss = [r["loss"] for r in records["aux"]]
    half = len(aux_loss) // 2
    residuals = [(x - m) / m for x, m in zip(aux_loss[half:], curves["aux"][half:])]
    print(json.dumps({
        "config": {"config": args.config, "iters": args.iters, "expert": state.ep_size, "processes": state.world_size,
                   "rate": args.rate, "skew": args.skew, "window": args.window, "overrides": args.overrides},
        "machine": dict(machine, load_average=[machine["load_average"], load_average()]),
        "runs": {name: dict(summary(recs, args.window), seconds=round(seconds[name], 1)) for name, recs in records.items()},
        "loss_running_mean_vs_aux": {name: max_gap(curves[name], curves["aux"]) for name in ("bias", "neither")},
        "aux_noise": round(statistics.pstdev(residuals), 5),
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
