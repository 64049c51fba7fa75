"""The cluster simulator against measurement: predicted vs measured MoE-layer time on 2, 4 and 8
CPU processes of this machine, per schedule and balancer, with a profile calibrated on the same
processes.

    python benchmarks/sim_validate.py                     # 2, 4 and 8 processes
    python benchmarks/sim_validate.py --worlds 2 --reps 3

Per world size (layouts: 2 = expert 2; 4 = tensor 2 x expert 2; 8 = tensor 2 x expert 2 x
expert_shard 2):

1. `tools/profile_comm.py --links` fits a profile on those processes: the flat ops the cost models
   read and the cluster links the simulator times with, and the expert compute of the layer's shape;
2. `benchmarks/moe_layer.py` times one MoE layer (forward + backward, median over --reps, the
   slowest rank) for every schedule row and balancer on skewed routing, and reports each
   data-parallel rank's routing counts per TP piece;
3. the simulator predicts each row's layer time from those counts and that profile
   (`Simulation.layer_seconds`: the same placements, since the balancers' own plans run on the
   same counts).

Prints a table and, on its last line, JSON with every row's measured and predicted ms and the
relative error (predicted / measured - 1), and the machine (with the load average before and
after each world size: other jobs on the cores move the measured side). On 2 cores, more
processes than cores share them: measured times are total work, which the calibration absorbs
only partly.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from megatron_moe.config.schema import Config
from megatron_moe.perf.hardware import load_profile
from megatron_moe.perf.machine import load_average, machine_info
from megatron_moe.sim.runner import Simulation

LAYOUTS = {2: dict(tensor=1, expert=2, expert_shard=1), 4: dict(tensor=2, expert=2, expert_shard=1),
           8: dict(tensor=2, expert=2, expert_shard=2)}
ROWS = {"baseline": ("baseline", False), "s1": ("s1", False), "s2": ("s2", False), "s2_saa": ("s2", True),
        "auto_saa": ("auto", True)}


def torchrun(nproc, *args, timeout=1200):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return proc.stdout


def layer_config(args, world: int, layout, row: str, balancer: str) -> Config:
    """benchmarks/moe_layer.py's layer as a one-layer model config."""
    schedule, saa = ROWS[row]
    cfg = Config()
    cfg.model.num_layers, cfg.model.hidden_size, cfg.model.seq_length = 1, args.hidden, args.seq
    cfg.model.num_attention_heads = 4
    cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.expert_ffn_hidden_size = args.experts, 2, args.ffn
    cfg.moe.schedule, cfg.moe.saa, cfg.moe.balancer = schedule, saa, balancer
    cfg.moe.flexmoe.interval = cfg.moe.eplb.interval = 1
    cfg.parallel.tensor, cfg.parallel.expert = layout["tensor"], layout["expert"]
    cfg.parallel.expert_shard = layout["expert_shard"]
    cfg.training.micro_batch_size = args.batch
    cfg.training.global_batch_size = args.batch * world // layout["tensor"]  # one micro-batch per data-parallel rank
    return cfg


def validate(args, world: int, tmp: str) -> dict:
    layout = LAYOUTS[world]
    flags = ["--tensor", str(layout["tensor"]), "--expert", str(layout["expert"]), "--expert-shard",
             str(layout["expert_shard"])]
    profile_path = os.path.join(tmp, f"profile_{world}.yaml")
    print(f"{world} processes: calibrating", flush=True)
    torchrun(world, "tools/profile_comm.py", *flags, "--hidden", str(args.hidden), "--ffn", str(args.ffn),
             "--min-elements", "4096", "--max-elements", str(1 << 19), "--points", "5", "--reps", str(args.reps),
             "--rows", "64,512,4096", "--links", "--out", profile_path)
    print(f"{world} processes: timing the layer", flush=True)
    rows = [row for row in ROWS if row != "s2_saa" or layout["tensor"] > 1]  # S2 + SAA is refused at tensor 1
    out = json.loads(torchrun(world, "benchmarks/moe_layer.py", *flags, "--rows", ",".join(rows), "--balancer",
                              ",".join(args.balancers), "--skew", str(args.skew), "--min-shadow", "1",
                              "--batch", str(args.batch), "--seq", str(args.seq), "--hidden", str(args.hidden),
                              "--ffn", str(args.ffn), "--experts", str(args.experts), "--reps", str(args.reps),
                              "--warmup", "1", "--profile", profile_path).strip().splitlines()[-1])
    pieces = np.array(out["routing_counts"], dtype=np.int64)  # [dp, tp, E]
    counts = pieces.sum(1)
    profile = load_profile(profile_path)
    rows = {}
    for name, measured in out["results"].items():
        if name == "deepspeed":
            continue
        row, balancer = (name.split("+") + ["none"])[:2]
        cfg = layer_config(args, world, layout, row, balancer)
        cfg.moe.fastermoe.min_shadow = 1
        sim = Simulation(cfg, profile, world, os.path.join(tmp, name))
        if sim.vexperts:  # moe_layer.py re-plans the slots after the first step (interval 1)
            sim.layer_ops(counts, pieces)
            sim.after_step(1, optimizer_state=False)
        predicted = sim.layer_seconds(counts, pieces) * 1e3
        rows[name] = {"measured_ms": measured["ms_median"], "predicted_ms": round(predicted, 3),
                      "error": round(predicted / measured["ms_median"] - 1, 3)}
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="2,4,8")
    p.add_argument("--balancers", default="none,fastermoe,proprophet,eplb")
    p.add_argument("--skew", type=float, default=1.2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    args.balancers = args.balancers.split(",")
    results, load = {}, {}
    machine = machine_info()
    with tempfile.TemporaryDirectory() as tmp:
        for world in (int(w) for w in args.worlds.split(",")):
            before = load_average()
            results[world] = validate(args, world, tmp)
            load[world] = [before, load_average()]
            for name, r in results[world].items():
                print(f"{world} procs {name:24s} measured {r['measured_ms']:8.2f} ms  predicted {r['predicted_ms']:8.2f} "
                      f"ms  error {r['error'] * 100:+.0f}%", flush=True)
    errors = [abs(r["error"]) for rows in results.values() for r in rows.values()]
    summary = {"mean_abs_error": round(float(np.mean(errors)), 3), "max_abs_error": round(float(np.max(errors)), 3),
               "per_world_mean_abs_error": {w: round(float(np.mean([abs(r["error"]) for r in rows.values()])), 3)
                                            for w, rows in results.items()}}
    print(json.dumps({"config": vars(args), "machine": dict(machine, load_average=load), "results": results,
                      "summary": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
