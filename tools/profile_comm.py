"""Fit the alpha-beta costs of Parm's collectives on the current machines and write a hardware profile.

    torchrun --nproc_per_node 8 tools/profile_comm.py --tensor 2 --expert 2 --expert-shard 2 \\
        --out configs/hardware/my_cluster.yaml

Times MP-AllGather (on `tp`), EP&ESP-AlltoAll (on `ep_esp`) and SAA (S2's phased exchange with
the overlapped all-gather) over a range of message sizes x (elements, fp32), as Parm §V-A / §VI-B
do (`megatron_moe/perf/calibrate.py`). Each point is the median over --reps of the slowest rank's
time; alpha and beta come from a least-squares fit whose R^2 is written into the profile with the
measured points. `moe.schedule: auto` reads the profile through `perf.hardware_profile`.
"""
import argparse
import platform
import sys

import torch

from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.launch import pick_backend
from megatron_moe.perf.calibrate import fit_profile, geometric_sizes, measure_points
from megatron_moe.perf.hardware import save_profile
from megatron_moe.perf.timing import init_state


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensor", type=int, default=1)
    p.add_argument("--expert", type=int, default=1)
    p.add_argument("--expert-shard", type=int, default=1)
    p.add_argument("--min-elements", type=int, default=1 << 14)
    p.add_argument("--max-elements", type=int, default=1 << 20)
    p.add_argument("--points", type=int, default=6, help="message sizes, geometric between min and max")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--name", default=None, help="profile name (default: from the output file)")
    p.add_argument("--out", required=True, help="profile YAML to write")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    state = init_state(args.tensor, args.expert, args.expert_shard)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_initialized() else torch.device("cpu")
    say = (lambda msg: print(msg, flush=True)) if state.rank == 0 else (lambda msg: None)
    points = measure_points(state, geometric_sizes(args.min_elements, args.max_elements, args.points), args.reps,
                            device, progress=say)
    if state.rank == 0:
        name = args.name or args.out.rsplit("/", 1)[-1].rsplit(".", 1)[0]
        fit = {"tool": "tools/profile_comm.py", "world_size": state.world_size,
               "layout": {"tensor": args.tensor, "expert": args.expert, "expert_shard": args.expert_shard},
               "backend": pick_backend("auto") if state.world_size > 1 else "none",
               "host": platform.node(), "reps": args.reps}
        profile = fit_profile(name, points, fit, f"fitted by tools/profile_comm.py on {state.world_size} ranks")
        for op in ("mp_allgather", "ep_esp_alltoall", "saa"):
            f = getattr(profile, op)
            say(f"{op:16s} alpha {f.alpha:.3e} s  beta {f.beta:.3e} s/element  R^2 {f.r2:.4f}")
        save_profile(profile, args.out)
        say(f"wrote {args.out}")
    C.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
