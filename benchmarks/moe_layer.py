"""One MoE layer, forward + backward, every schedule and balancer side by side (Parm §VI-C style).

    torchrun --nproc_per_node 8 benchmarks/moe_layer.py --tensor 2 --expert 2 --expert-shard 2
    torchrun --nproc_per_node 2 benchmarks/moe_layer.py --expert 2 --rows baseline --balancer none,fastermoe --skew 1.2

Rows: baseline (Parm Fig. 3(a), DeepSpeed-MoE style), s1, s2 (AAS), s2_saa, auto (Alg. 1 with
--profile, S2 with AAS), auto_saa (S2 with SAA) and auto_saa_s1_phased: auto + SAA as it ran
before review issue #15 item 5, S1's combine through SAA's phased point-to-point exchange instead
of its plain all-to-all (kept to measure that fix in the same run). Every layer gets the same
weights (seeded) and every data-parallel rank its own tokens. Each schedule row runs once per
--balancer (rows named `<schedule>+<balancer>` for balancers other than none) and, with --smart,
also with FasterMoE's smart schedule (`+smart`, rows without SAA). --skew S adds a
fixed Zipf(S) bias, -S ln(e + 1), to every router's logits (`Router.logit_bias`, a measurement
hook: expert 0 most popular), so balancers have imbalance to fix. Without --profile, the rows
that need a hardware profile (auto, fastermoe) use one calibrated on these ranks
(`perf/calibrate.py`, cached). Repetitions are interleaved (rep 1 of every row, then rep 2, ...) so
that load drifts hit every row alike; a repetition's time is the slowest rank's.

Reported per row: median ms over --reps after --warmup; `bytes` (rank 0) and `bytes_all_ranks`
(summed over every rank) per "<op kind>/<group>" for one forward + backward, and
`inter_node_bytes_all_ranks` the part sent across (simulated, --ranks-per-node) nodes; `exposed_ms` /
`total_ms` per op kind (rank 0's median: time blocked by communication vs its whole span);
speedup_vs_baseline = baseline median / row median; `max_abs_diff_vs_baseline`: the largest
difference of the layer output and input gradient from the baseline row's, over all ranks (every
row computes the same math, so this is float rounding); `balance_ratio`: max / mean over EP ranks
of the rows each computes (FlexMoE Eq. 6, summed over the ep_esp groups; last repetition);
`replicas`, `trans_bytes`, `agg_bytes`: expert replicas and their weight / gradient bytes (rank
0); for auto rows the schedule Alg. 1 picked (last repetition). Rank 0 prints one JSON object on
its last line. Default shapes are sized for 8 processes on 2 CPU cores.
"""
import argparse
import json
import statistics
import sys

import torch

from megatron_moe.config.schema import Config
from megatron_moe.distributed import collectives as C
from megatron_moe.model.param_meta import init_model_from_seed_
from megatron_moe.moe.balancers import BALANCERS
from megatron_moe.moe.layer import MoELayer
from megatron_moe.moe.schedules.parm import Auto
from megatron_moe.perf.calibrate import resolve_hardware_profile
from megatron_moe.perf.timing import init_state, slowest_rank_seconds

ROWS = {  # name -> (moe.schedule, moe.saa)
    "baseline": ("baseline", False),
    "s1": ("s1", False),
    "s2": ("s2", False),
    "s2_saa": ("s2", True),
    "auto": ("auto", False),
    "auto_saa": ("auto", True),
    "auto_saa_s1_phased": ("auto", True),
}


class AutoWithPhasedS1(Auto):
    """auto + SAA before issue #15 item 5: S1's combine phased like SAA (pure overhead)."""

    def uses_saa(self, routed) -> bool:
        return self.cfg.moe.saa


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
    p.add_argument("--profile", default=None, help="hardware profile for auto / fastermoe (default: calibrate here)")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {', '.join(ROWS)}")
    p.add_argument("--balancer", default="none", help="comma-separated balancers, each run with every row")
    p.add_argument("--skew", type=float, default=0.0, help="Zipf exponent of a fixed router-logit bias (0 = none)")
    p.add_argument("--min-shadow", type=int, default=0, help="moe.fastermoe.min_shadow")
    p.add_argument("--smart", action="store_true",
                   help="also run every row without SAA with FasterMoE's smart schedule (rows '<name>+smart')")
    p.add_argument("--smart-group-size", type=int, default=1, help="moe.smart_group_size")
    p.add_argument("--gate", default="softmax", help="moe.gate (topology: FasterMoE's topology-aware gate)")
    p.add_argument("--ranks-per-node", type=int, default=None, help="simulated node size (inter-node bytes)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    args.rows = [r for r in args.rows.split(",") if r]
    args.balancer = [b for b in args.balancer.split(",") if b]
    unknown = set(args.rows) - ROWS.keys()
    if unknown or "baseline" not in args.rows:
        p.error(f"--rows: unknown {sorted(unknown)} (choose from {', '.join(ROWS)}; baseline is required)")
    if "none" not in args.balancer or set(args.balancer) - set(BALANCERS.names()):
        p.error(f"--balancer: choose from {', '.join(BALANCERS.names())} (none is required)")
    return args


def layer_config(args, schedule: str, saa: bool, balancer: str = "none", smart: bool = False) -> Config:
    cfg = Config()
    m, moe = cfg.model, cfg.moe
    m.hidden_size, m.activation, m.seq_length = args.hidden, args.activation, args.seq
    moe.num_experts, moe.top_k, moe.capacity_factor = args.experts, args.top_k, args.capacity_factor
    moe.expert_ffn_hidden_size, moe.schedule, moe.saa = args.ffn, schedule, saa
    moe.balancer, moe.fastermoe.min_shadow = balancer, args.min_shadow
    moe.smart_schedule, moe.smart_group_size, moe.gate = smart, args.smart_group_size, args.gate
    cfg.parallel.tensor, cfg.parallel.expert, cfg.parallel.expert_shard = args.tensor, args.expert, args.expert_shard
    cfg.perf.hardware_profile = args.profile
    return cfg


def build_layer(args, row: str, balancer: str, smart: bool, state, device) -> MoELayer:
    schedule, saa = ROWS[row]
    cfg = layer_config(args, schedule, saa, balancer, smart)
    layer = MoELayer(cfg, state, layer_index=0)
    if row == "auto_saa_s1_phased":
        layer.schedule = AutoWithPhasedS1(cfg, state)
    if args.skew:
        layer.router.logit_bias = -args.skew * torch.log(torch.arange(1, args.experts + 1, dtype=torch.float32))
    init_model_from_seed_(layer, args.seed, state)
    return layer.to(device)


def bytes_of_kind(counters: dict, kind: str) -> int:
    """Bytes of one op kind over all groups in a COMM_STATS snapshot ("<kind>/<group>" keys)."""
    return sum(n for key, n in counters.items() if key.split("/")[0] == kind)


def row_name(row: str, balancer: str, smart: bool) -> str:
    return row + ("" if balancer == "none" else f"+{balancer}") + ("+smart" if smart else "")


def sum_over_ranks(counters: dict, state) -> dict:
    """{key: int} of this rank -> the same keys summed over every rank (keys of all ranks)."""
    keys = sorted(set().union(*C.all_gather_object(sorted(counters), state.world)))
    totals = torch.tensor([counters.get(k, 0) for k in keys], dtype=torch.int64)
    return dict(zip(keys, C.all_reduce(totals, state.world).tolist()))


def main(argv=None) -> int:
    args = parse_args(argv)
    state = init_state(args.tensor, args.expert, args.expert_shard, ranks_per_node=args.ranks_per_node)
    torch.set_num_threads(1)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_initialized() else torch.device("cpu")
    gen = torch.Generator().manual_seed(args.seed + state.dp.rank)  # same tokens on a TP group
    x = torch.randn(args.batch, args.seq, args.hidden, generator=gen).to(device)
    grad = torch.randn(args.batch, args.seq, args.hidden, generator=gen).to(device)
    if args.profile is None:  # one profile, calibrated here (or cached), for every row that needs one
        every_need = layer_config(args, "auto", False, "fastermoe" if "fastermoe" in args.balancer else "none")
        args.profile = resolve_hardware_profile(every_need, state, device, say=lambda msg: print(msg, flush=True),
                                                run_dir_copy=False).perf.hardware_profile
    variants = [(row, b, smart) for smart in ([False, True] if args.smart else [False]) for b in args.balancer
                for row in args.rows if not (smart and ROWS[row][1])]  # the smart schedule replaces SAA
    layers = {row_name(*v): build_layer(args, *v, state, device) for v in variants}
    times = {name: [] for name in layers}
    comm_times = {name: [] for name in layers}
    bytes_, inter_node, picked, outputs, loads, replicas = {}, {}, {}, {}, {}, {}

    def step(name):
        layer = layers[name]
        C.COMM_STATS.reset()
        inp = x.clone().requires_grad_(True)
        y, aux = layer(inp)
        ((y * grad).sum() + aux).backward()
        bytes_[name], inter_node[name] = C.COMM_STATS.snapshot(), dict(C.COMM_STATS.inter_node)
        comm_times[name].append(C.COMM_STATS.seconds_by_kind())
        picked[name], replicas[name] = layer.last_stats.schedule, layer.last_stats.replicas
        loads[name] = layer.last_stats.tokens_per_ep_rank
        outputs.setdefault(name, (y.detach(), inp.grad))
        layer.zero_grad(set_to_none=True)

    for rep in range(args.warmup + args.reps):
        for name in layers:
            seconds = slowest_rank_seconds(lambda: step(name), state)
            if rep >= args.warmup:
                times[name].append(seconds * 1e3)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    results = {}
    for name in layers:
        diff = max(float((a - b).abs().max()) for a, b in zip(outputs[name], outputs["baseline"]))
        diff = float(C.all_reduce(torch.tensor([diff], dtype=torch.float64), state.world, op="max"))
        timed = comm_times[name][args.warmup:] or comm_times[name]
        load = C.all_reduce(loads[name].double(), state.edp)  # [ep] rows per EP rank, all ep_esp groups
        results[name] = {
            "ms_median": round(medians[name], 3), "speedup_vs_baseline": round(medians["baseline"] / medians[name], 3),
            "bytes": dict(sorted(bytes_[name].items())), "bytes_all_ranks": sum_over_ranks(bytes_[name], state),
            "inter_node_bytes_all_ranks": sum_over_ranks(inter_node[name], state),
            **{f"{part}_ms": {kind: round(statistics.median(t[part].get(kind, 0.0) for t in timed) * 1e3, 3)
                              for kind in timed[-1][part]} for part in ("exposed", "total")},
            "max_abs_diff_vs_baseline": diff,
            "balance_ratio": round(float(load.max() / load.mean().clamp(min=1e-12)), 4),
            "replicas": replicas[name], "trans_bytes": bytes_of_kind(bytes_[name], "trans"),
            "agg_bytes": bytes_of_kind(bytes_[name], "agg"),
        }
        if ROWS[name.split("+")[0]][0] == "auto":
            results[name]["picked"] = picked[name]
    config = dict(vars(args), world_size=state.world_size, data_parallel=state.dp_size, device=str(device))
    if state.rank == 0:
        for name, r in results.items():
            print(f"{name:28s} {r['ms_median']:9.2f} ms  x{r['speedup_vs_baseline']:.2f}  "
                  f"balance {r['balance_ratio']:.3f}  replicas {r['replicas']}", flush=True)
        print(json.dumps({"config": config, "results": results}), flush=True)
    C.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
