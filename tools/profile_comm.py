"""Fit the alpha-beta costs of the collectives and expert compute the cost models use, on the
current machines, and write a hardware profile (Parm §V-A / §VI-B; FasterMoE §3).

    torchrun --nproc_per_node 8 tools/profile_comm.py --tensor 2 --expert 2 --expert-shard 2 \\
        --hidden 1024 --ffn 4096 --out configs/hardware/my_cluster.yaml

Times MP-AllGather (`tp`), EP&ESP-AlltoAll and SAA (`ep_esp`), point-to-point and broadcast
(`ep`) over a range of message sizes x (elements, fp32), and the expert FFN forward of the given
shape (x = FLOPs) at several row counts (`megatron_moe/training/calibrate.py`). Each point is the
median over --reps of the slowest rank's time; alpha and beta come from a least-squares fit whose
R^2 is written into the profile with the measured points. `moe.schedule: auto` and
`moe.balancer: fastermoe` read it through `perf.hardware_profile` (without one they calibrate a
smaller profile at start-up).

--links also times every collective of the cluster simulator's `cluster` block (all-to-all,
all-gather, all-reduce, point to point, broadcast, reduce) on all the ranks and writes it into
the profile as inside-a-node links (docs/simulator.md): a calibrated profile for
`tools/simulate.py` and `benchmarks/sim_validate.py`.
"""
from dataclasses import replace
import argparse
import sys

import torch

from megatron_moe.distributed import collectives as C
from megatron_moe.training.calibrate import (ExpertShape, fit_description, fit_links, fit_profile, geometric_sizes,
                                         measure_links, measure_points, recorded)
from megatron_moe.perf.hardware import OPS, save_profile
from megatron_moe.distributed.rank_timing import init_state


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensor", type=int, default=1)
    p.add_argument("--expert", type=int, default=1)
    p.add_argument("--expert-shard", type=int, default=1)
    p.add_argument("--min-elements", type=int, default=1 << 14)
    p.add_argument("--max-elements", type=int, default=1 << 20)
    p.add_argument("--points", type=int, default=6, help="message sizes, geometric between min and max")
    p.add_argument("--hidden", type=int, default=1024, help="expert_compute: the experts' hidden size")
    p.add_argument("--ffn", type=int, default=4096, help="expert_compute: FFN units of one expert (all shards)")
    p.add_argument("--swiglu", action="store_true", help="expert_compute: SwiGLU experts (gate + up)")
    p.add_argument("--rows", default="64,256,1024,4096", help="expert_compute: rows timed (comma-separated)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {', '.join(OPS)}")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--links", action="store_true", help="also fit the simulator's cluster links on all ranks")
    p.add_argument("--name", default=None, help="profile name (default: from the output file)")
    p.add_argument("--out", required=True, help="profile YAML to write")
    args = p.parse_args(argv)
    args.ops, args.rows = args.ops.split(","), [int(r) for r in args.rows.split(",")]
    if set(args.ops) - set(OPS):
        p.error(f"--ops: unknown {sorted(set(args.ops) - set(OPS))}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    state = init_state(args.tensor, args.expert, args.expert_shard)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_initialized() else torch.device("cpu")
    say = (lambda msg: print(msg, flush=True)) if state.rank == 0 else (lambda msg: None)
    shape = ExpertShape(args.hidden, args.ffn // args.expert_shard, args.swiglu)
    points = measure_points(state, geometric_sizes(args.min_elements, args.max_elements, args.points), args.reps,
                            device, shape, args.rows, args.ops, progress=say)
    links = measure_links(state, geometric_sizes(args.min_elements, args.max_elements, args.points), args.reps,
                          device, progress=say) if args.links else None
    if state.rank == 0:
        name = args.name or args.out.rsplit("/", 1)[-1].rsplit(".", 1)[0]
        profile = fit_profile(name, points, fit_description(state, "tools/profile_comm.py", args.reps, shape),
                              f"fitted by tools/profile_comm.py on {state.world_size} ranks")
        for op in args.ops:
            f = getattr(profile, op)
            unit = "FLOP" if op == "expert_compute" else "element"
            say(f"{op:16s} alpha {f.alpha:.3e} s  beta {f.beta:.3e} s/{unit}  R^2 {f.r2 if f.r2 is not None else '-'}")
        if links is not None:
            profile = replace(profile, cluster=fit_links(links), fit=dict(profile.fit, link_points=recorded(links)))
            for kind, link in profile.cluster.links.items():
                say(f"link {kind:12s} alpha {link.intra.alpha:.3e} s  beta {link.intra.beta:.3e} s/element  "
                    f"R^2 {link.intra.r2:.3f}")
        save_profile(profile, args.out)
        say(f"wrote {args.out}")
    C.destroy_process_group(state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
