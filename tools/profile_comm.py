"""Fit the alpha-beta costs of Parm's collectives on the current machines and write a hardware profile.

    torchrun --nproc_per_node 8 tools/profile_comm.py --tensor 2 --expert 2 --expert-shard 2 \\
        --out configs/hardware/my_cluster.yaml

Times, over a range of message sizes x (elements, fp32), on the layout's groups (Parm §V-A, §VI-B):

* mp_allgather:    MP-AllGather on `tp` whose gathered output has x elements;
* ep_esp_alltoall: EP&ESP-AlltoAll on `ep_esp` with x input elements per rank, split evenly;
* saa:             S2's second EP&ESP-AlltoAll as SAA (`EpEspExchange`, moe/schedules/parm.py):
                   x elements of partial sums per rank, phased over `ep_esp`, with the MP-AllGather
                   of the combined rows on `tp` overlapped.

Each point is the median over --reps of the slowest rank's time; alpha and beta come from a least
squares fit (perf/alpha_beta.py), whose R^2 is written into the profile with the measured points.
`moe.schedule: auto` reads the profile through `perf.hardware_profile`.
"""
import argparse
import platform
import statistics
import sys

import torch

from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.launch import pick_backend
from megatron_moe.moe.placement import Placement
from megatron_moe.moe.schedules.parm import EpEspExchange
from megatron_moe.perf.alpha_beta import fit_alpha_beta
from megatron_moe.perf.hardware import HardwareProfile, save_profile
from megatron_moe.perf.timing import init_state, slowest_rank_seconds

WIDTH = 64  # elements per row


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


def _rows(elements: int, parts: int) -> int:
    """Rows per part so that `parts` parts of WIDTH-element rows hold about `elements` elements."""
    return max(1, round(elements / (parts * WIDTH)))


def _ops(state, device):
    """name -> (x elements actually moved, callable) builders for one message size."""
    tp, ep_esp = state.tp, state.ep_esp

    def allgather(elements):
        piece = torch.randn(_rows(elements, tp.size), WIDTH, device=device)
        return piece.numel() * tp.size, lambda: C.all_gather(piece, tp)

    def alltoall(elements):
        per_peer = _rows(elements, ep_esp.size)
        t = torch.randn(per_peer * ep_esp.size, WIDTH, device=device)
        splits = [per_peer] * ep_esp.size
        return t.numel(), lambda: C.all_to_all_v(t, splits, splits, ep_esp)

    def saa(elements):
        # one expert per EP rank; every ep_esp source sends it `per_source` rows, so each rank holds
        # per_source rows of partial sums from every source and returns them phased (S2's layout)
        per_source = _rows(elements, ep_esp.size)
        counts = torch.full((ep_esp.size, state.ep_size), per_source, dtype=torch.long)
        exchange = EpEspExchange(state, Placement.owner_only(counts, state.ep_size),
                                 [per_source * state.ep_size] * tp.size, saa=True, device=device)
        out = torch.randn(per_source * ep_esp.size, WIDTH, device=device)
        return out.numel(), lambda: exchange.up(out)

    return {"mp_allgather": allgather, "ep_esp_alltoall": alltoall, "saa": saa}


def main(argv=None) -> int:
    args = parse_args(argv)
    state = init_state(args.tensor, args.expert, args.expert_shard)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_initialized() else torch.device("cpu")
    ratio = (args.max_elements / args.min_elements) ** (1 / max(1, args.points - 1))
    sizes = [round(args.min_elements * ratio ** i) for i in range(args.points)]
    fits, points = {}, {}
    for name, build in _ops(state, device).items():
        xs, times = [], []
        for size in sizes:
            elements, run = build(size)
            run()  # warm-up
            xs.append(elements)
            times.append(statistics.median(slowest_rank_seconds(run, state) for _ in range(args.reps)))
        fits[name] = fit_alpha_beta(xs, times)
        points[name] = {"elements": xs, "seconds": [float(f"{t:.6g}") for t in times]}
        if state.rank == 0:
            f = fits[name]
            print(f"{name:16s} alpha {f.alpha:.3e} s  beta {f.beta:.3e} s/element  R^2 {f.r2:.4f}", flush=True)
    if state.rank == 0:
        name = args.name or args.out.rsplit("/", 1)[-1].rsplit(".", 1)[0]
        fit = {"tool": "tools/profile_comm.py", "world_size": state.world_size,
               "layout": {"tensor": args.tensor, "expert": args.expert, "expert_shard": args.expert_shard},
               "backend": pick_backend("auto") if state.world_size > 1 else "none",
               "host": platform.node(), "reps": args.reps, "points": points}
        save_profile(HardwareProfile(name, description=f"fitted by tools/profile_comm.py on {state.world_size} ranks",
                                     fit=fit, **fits), args.out)
        print(f"wrote {args.out}")
    C.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
