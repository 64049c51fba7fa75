"""The experts' grouped GEMM, forward + backward over gradient accumulation, on the kernels
`moe/grouped_gemm.py` chooses between (issue #16), side by side on the same shapes.

    python benchmarks/grouped_gemm.py
    python benchmarks/grouped_gemm.py --shapes 128x256x64x128,8x2048x256x1024 --micro-batches 8

Per shape GxRxKxN (G experts, R rows routed uniformly at random, weights [G, K, N]) and per row:
--micro-batches forward + backward passes of one projection into one weight stack, its gradient
accumulated as a training step's micro-batches do (set to None first):

* `autograd`: `torch._grouped_mm` with its own backward (dW into a fresh [G, K, N], then added);
* `padded`, `native_temp`, `per_group`: `grouped_mm_into_grad` with its CPU dW kernel forced
  (every group padded to the largest count and one `baddbmm_`; `torch._grouped_mm` into a
  temporary then added; one `addmm_` per non-empty group, in place);
* `chosen`: `grouped_mm_into_grad` as the trainer runs it (`Groups.own_wgrad_pays` and
  `Groups.padding_pays` decide; the JSON says whether torch's kernel is native here, `native`,
  and which dW kernel `wgrad_kernel` picks).

Rows alternate within each repetition; per shape the rows are printed fastest first (median ms over
--reps), then one JSON object. Every row's gradient equals `autograd`'s (checked: relative
norm of the difference < 1e-5).
"""
import argparse
import json
import statistics

import torch

from megatron_moe.moe import grouped_gemm as gg
from megatron_moe.perf import timing

KERNELS = {  # (_PAD_MAX_ROWS_PER_GROUP, _PAD_MAX_BLOWUP, _NATIVE_TEMP_MAX_ELEMENTS) forcing each CPU dW kernel
    "padded": (1 << 30, 1 << 30, 0),
    "native_temp": (0, 0, 1 << 62),
    "per_group": (0, 0, 0),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="8x256x64x128,128x256x64x128,256x1024x64x128,8x2048x256x1024,64x2048x256x1024",
                   help="comma-separated GxRxKxN")
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    return args


def run_row(name, leaf, xs, dys, counts, offsets):
    leaf.grad = None
    if name == "autograd":
        for x, dy in zip(xs, dys):
            torch._grouped_mm(x, leaf, offs=offsets).backward(dy)
        return
    saved = (gg._PAD_MAX_ROWS_PER_GROUP, gg._PAD_MAX_BLOWUP, gg._NATIVE_TEMP_MAX_ELEMENTS)
    if name in KERNELS:  # forced: a stand-in scheduler sends every call through our dW path
        gg._PAD_MAX_ROWS_PER_GROUP, gg._PAD_MAX_BLOWUP, gg._NATIVE_TEMP_MAX_ELEMENTS = KERNELS[name]
    try:
        for x, dy in zip(xs, dys):
            gg.grouped_mm_into_grad(x, leaf, 1.0, counts, _RunNow() if name in KERNELS else None).backward(dy)
    finally:
        gg._PAD_MAX_ROWS_PER_GROUP, gg._PAD_MAX_BLOWUP, gg._NATIVE_TEMP_MAX_ELEMENTS = saved


class _RunNow:
    """A `WGradScheduler` stand-in that runs each dW at once (forces the own-dW path)."""

    @staticmethod
    def defer(flops, work, params):
        work()


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    results = {}
    for G, R, K, N in args.shapes:
        gen = torch.Generator().manual_seed(args.seed)
        counts = torch.bincount(torch.randint(0, G, (R,), generator=gen), minlength=G)
        offsets = counts.cumsum(0).to(torch.int32)
        leaf = torch.nn.Parameter(torch.randn(G, K, N, generator=gen) * 0.02)
        xs = [torch.randn(R, K, generator=gen, requires_grad=True) for _ in range(args.micro_batches)]
        dys = [torch.randn(R, N, generator=gen) for _ in range(args.micro_batches)]
        rows = ["autograd", *KERNELS, "chosen"]
        times, grads = {r: [] for r in rows}, {}
        for rep in range(args.reps + 1):  # the first repetition warms up
            for r in rows:
                with timing.wall(leaf.device) as took:
                    run_row(r, leaf, xs, dys, counts.tolist(), offsets)
                if rep:
                    times[r].append(took.seconds * 1e3)
                grads[r] = leaf.grad.clone()
        for r in rows:  # the same sums in another order: float rounding only
            error = float((grads[r] - grads["autograd"]).norm() / grads["autograd"].norm())
            if not error < 1e-5:
                raise SystemExit(f"{r}: gradient differs from autograd's by {error:.2e} (relative norm)")
        key = f"{G}x{R}x{K}x{N}"
        groups = gg.Groups(counts.tolist())
        native = gg.native_kernel("cpu", None, leaf.dtype, G, K, N)  # the path choice (moe/grouped_gemm.py)
        results[key] = {"ms": {r: round(statistics.median(t), 3) for r, t in times.items()},
                        "max_rows": int(counts.max()), "padding_pays": groups.padding_pays,
                        "own_wgrad_pays": groups.own_wgrad_pays(torch.device("cpu"), G * K * N),
                        "native": native, "wgrad_kernel": gg.wgrad_kernel("cpu", native, True, groups.padding_pays,
                                                                          G * K * N)}
        ranked = sorted(rows, key=lambda r: results[key]["ms"][r])
        print(f"{key:>20s}  " + "  ".join(f"{r} {results[key]['ms'][r]:.2f}" for r in ranked), flush=True)
    print(json.dumps({"config": {"micro_batches": args.micro_batches, "reps": args.reps,
                                 "threads": torch.get_num_threads()}, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
