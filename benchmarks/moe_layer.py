"""One MoE layer, forward + backward, every schedule side by side (Parm §VI-C style).

    torchrun --nproc_per_node 8 benchmarks/moe_layer.py --tensor 2 --expert 2 --expert-shard 2

Rows: baseline (Parm Fig. 3(a), DeepSpeed-MoE style), s1, s2 (AAS), s2_saa, auto (Alg. 1 with
--profile; its S2 with AAS unless --auto-saa), and `deepspeed` when it is importable (not a
dependency; when absent the row is left out and the config says so). Every layer gets the same
weights (seeded) and every data-parallel rank its own tokens. Repetitions are interleaved (rep 1
of every row, then rep 2, ...) so that load drifts hit every row alike; a repetition's time is the
slowest rank's. Reported per row: median ms over --reps after --warmup, rank 0's bytes per
"<op kind>/<group>" from COMM_STATS for one forward + backward, speedup_vs_baseline = baseline
median / row median, and for auto the schedule Alg. 1 picked (last repetition). Rank 0 prints one
JSON object on its last line. Default shapes are sized for 8 processes on 2 CPU cores.
"""
import argparse
import importlib.util
import json
import statistics
import sys

import torch

from megatron_moe.config.schema import Config
from megatron_moe.distributed import collectives as C
from megatron_moe.model.param_meta import init_model_from_seed_
from megatron_moe.moe.layer import MoELayer
from megatron_moe.perf.timing import init_state, slowest_rank_seconds

ROWS = {  # name -> (moe.schedule, moe.saa); auto's saa comes from --auto-saa
    "baseline": ("baseline", False),
    "s1": ("s1", False),
    "s2": ("s2", False),
    "s2_saa": ("s2", True),
    "auto": ("auto", None),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensor", type=int, default=1)
    p.add_argument("--expert", type=int, default=1)
    p.add_argument("--expert-shard", type=int, default=1)
    p.add_argument("--batch", type=int, default=4, help="micro-batch size per data-parallel rank")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=1024, help="expert FFN hidden size")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=None, help="default: dropless")
    p.add_argument("--activation", default="gelu", choices=["gelu", "swiglu"])
    p.add_argument("--profile", default="configs/hardware/cpu_gloo_8proc.yaml", help="hardware profile for auto")
    p.add_argument("--auto-saa", action="store_true", help="auto's S2 uses SAA (default: AAS)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


def layer_config(args, schedule: str, saa: bool) -> Config:
    cfg = Config()
    m, moe = cfg.model, cfg.moe
    m.hidden_size, m.activation, m.seq_length = args.hidden, args.activation, args.seq
    moe.num_experts, moe.top_k, moe.capacity_factor = args.experts, args.top_k, args.capacity_factor
    moe.expert_ffn_hidden_size, moe.schedule, moe.saa = args.ffn, schedule, saa
    cfg.parallel.tensor, cfg.parallel.expert, cfg.parallel.expert_shard = args.tensor, args.expert, args.expert_shard
    cfg.perf.hardware_profile = args.profile
    return cfg


def main(argv=None) -> int:
    args = parse_args(argv)
    state = init_state(args.tensor, args.expert, args.expert_shard)
    torch.set_num_threads(1)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_initialized() else torch.device("cpu")
    gen = torch.Generator().manual_seed(args.seed + state.dp.rank)  # same tokens on a TP group
    x = torch.randn(args.batch, args.seq, args.hidden, generator=gen).to(device)
    grad = torch.randn(args.batch, args.seq, args.hidden, generator=gen).to(device)
    layers = {}
    for name, (schedule, saa) in ROWS.items():
        saa = args.auto_saa if saa is None else saa
        layer = MoELayer(layer_config(args, schedule, saa), state, layer_index=0).to(device)
        init_model_from_seed_(layer, args.seed, state)
        layers[name] = layer
    times = {name: [] for name in layers}
    bytes_, picked = {}, {}

    def step(name):
        layer = layers[name]
        C.COMM_STATS.reset()
        inp = x.clone().requires_grad_(True)
        y, aux = layer(inp)
        ((y * grad).sum() + aux).backward()
        bytes_[name] = C.COMM_STATS.snapshot()
        picked[name] = layer.last_stats.schedule
        layer.zero_grad(set_to_none=True)

    for rep in range(args.warmup + args.reps):
        for name in layers:
            seconds = slowest_rank_seconds(lambda: step(name), state)
            if rep >= args.warmup:
                times[name].append(seconds * 1e3)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    results = {name: {"ms_median": round(medians[name], 3), "bytes": dict(sorted(bytes_[name].items())),
                      "speedup_vs_baseline": round(medians["baseline"] / medians[name], 3)} for name in layers}
    results["auto"]["picked"] = picked["auto"]
    config = {k: v for k, v in vars(args).items()}
    config.update(world_size=state.world_size, data_parallel=state.dp_size, device=str(device),
                  deepspeed="installed" if importlib.util.find_spec("deepspeed") else "not installed: row omitted")
    if state.rank == 0:
        for name, r in results.items():
            print(f"{name:9s} {r['ms_median']:9.2f} ms  x{r['speedup_vs_baseline']:.2f}", flush=True)
        print(json.dumps({"config": config, "results": results}), flush=True)
    C.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
