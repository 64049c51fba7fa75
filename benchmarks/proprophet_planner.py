"""Pro-Prophet's planner (Alg. 1, `techniques/proprophet/proprophet.py`): how fast it is and how good its
plans are, on Zipf-skewed routing (one process; no communication).

    python benchmarks/proprophet_planner.py
    python benchmarks/proprophet_planner.py --sizes 64x64,256x256 --skew 1.2 --reps 20

Speed, per "ExD" size (E experts over D devices = EP ranks): the median wall time of
`greedy_search` (the `Plan` primitive, run every `moe.proprophet.plan_interval` iterations) and of
`lightweight_placement` (turning the plan into this forward's routing table, every forward), over
--reps random distributions; with the predicted layer time T' (Eq. 6) before and after, the
balance ratio (max / mean rows computed) before and after, and the replicas chosen.

Quality, on every small case an exhaustive search can cover (E <= 6, D <= 3, --quality-cases
random skewed distributions and costs): Alg. 1's T' over the optimum's (`exhaustive_search`),
mean and worst, and how often it is optimal.

Costs: the cost model is the one training builds (`ProphetCostModel.from_profile`) from --profile
(default `configs/hardware/cpu_gloo_2proc.yaml`, fitted on this machine) for one expert of --hidden x --ffn and --tokens
rows per device (top-k included). Prints one JSON object.
"""
import argparse
import json
import statistics

import numpy as np
import torch

from megatron_moe.techniques.proprophet.proprophet import (Loads, greedy_search, lightweight_placement, predicted_time,
                                                   ratios_to_optimum)
from megatron_moe.perf import timing
from megatron_moe.training.calibrate import ExpertShape
from megatron_moe.perf.hardware import load_profile
from megatron_moe.techniques.proprophet.proprophet_model import ProphetCostModel
from megatron_moe.sim.traces import zipf_rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="8x2,16x4,64x8,64x64,256x64,256x256", help="comma-separated ExD")
    p.add_argument("--skew", type=float, default=1.2, help="Zipf exponent of expert popularity")
    p.add_argument("--tokens", type=int, default=4096, help="rows each device routes (tokens x top-k)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--alpha", type=float, default=0.5, help="Eq. 7's balance threshold (moe.proprophet.alpha)")
    p.add_argument("--profile", default="configs/hardware/cpu_gloo_2proc.yaml")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--quality-cases", type=int, default=120)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def balance(T: np.ndarray, chosen) -> float:
    loads = Loads(T)
    for e, devices in chosen:
        loads.replicate(e, devices)
    return float(loads.H.max() / loads.H.mean())


def speed(args, model: ProphetCostModel, experts: int, devices: int) -> dict:
    rng = np.random.default_rng(args.seed)
    search_s, place_s, before, after, ratio_before, ratio_after, replicas = [], [], [], [], [], [], []
    for _ in range(args.reps):
        T = zipf_rows(rng, experts, devices, args.tokens, args.skew)
        with timing.wall() as searched:  # host work
            chosen = greedy_search(T, model, args.alpha)
        search_s.append(searched.seconds)
        counts = torch.from_numpy(T)  # one source per device
        with timing.wall() as placed:
            lightweight_placement(counts, list(range(devices)), devices, chosen)
        place_s.append(placed.seconds)
        before.append(predicted_time(T, model, []))
        after.append(predicted_time(T, model, chosen))
        ratio_before.append(balance(T, []))
        ratio_after.append(balance(T, chosen))
        replicas.append(sum(len(d) - 1 for _, d in chosen))
    med = statistics.median
    return {"search_ms": round(med(search_s) * 1e3, 3), "search_ms_max": round(max(search_s) * 1e3, 3),
            "placement_ms": round(med(place_s) * 1e3, 3),
            "predicted_ms_before": round(med(before) * 1e3, 3), "predicted_ms_after": round(med(after) * 1e3, 3),
            "balance_ratio_before": round(med(ratio_before), 3), "balance_ratio_after": round(med(ratio_after), 3),
            "replicas": med(replicas)}


def quality(args, cases: int) -> dict:
    """Alg. 1 vs the exhaustive optimum on small random cases (costs varied around a replica's)."""
    ratios = ratios_to_optimum(cases, args.seed, args.skew)
    return {"cases": cases, "mean_ratio_to_optimum": round(sum(ratios) / len(ratios), 4),
            "worst_ratio": round(max(ratios), 4), "optimal": sum(r < 1 + 1e-9 for r in ratios)}


def main(argv=None) -> int:
    args = parse_args(argv)
    shape = ExpertShape(args.hidden, args.ffn)
    model = ProphetCostModel.from_profile(load_profile(args.profile), args.hidden, shape.params(False, 1),
                                          shape.flops_per_row, 0.0, overlap=False)
    sizes = {}
    for size in args.sizes.split(","):
        experts, devices = (int(v) for v in size.lower().split("x"))
        if experts % devices:
            raise SystemExit(f"--sizes {size}: E must be a multiple of D")
        sizes[size] = speed(args, model, experts, devices)
    out = {"config": {k: v for k, v in vars(args).items()}, "speed": sizes,
           "quality": quality(args, args.quality_cases)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
