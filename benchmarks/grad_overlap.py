"""Data-parallel gradient reduction overlapped with backward (`optimizer.overlap_grad_reduce`,
issue #44 item 6) against the reduction after backward, on data-parallel processes:

    torchrun --nproc_per_node 2 benchmarks/grad_overlap.py                    # 12 steps each, 2 warm-up
    torchrun --nproc_per_node 2 benchmarks/grad_overlap.py --steps 20 optimizer.grad_bucket_mb=4

Two trainers of the same config (`--config` plus the default shape overrides below, then the
command line's), one per setting, step in turn (`off`, `on`, `off`, ...) so both see the same
machine load. Per step: the wall time (`perf/timing.py` Stopwatch), and of the gradient buckets'
replica sums (COMM_STATS around `sync`: "all_reduce" -- "grad_reduce_scatter" with
`optimizer.distributed=true` -- over ``dp``, the dense buckets, and ``edp``, the expert buckets, or
their side channels "dp_side" / "edp_side" when overlapped; each op's *exposed* time, the issue
call plus the wait, and *total*, issue to completion; the collectives' accounting,
distributed/collectives.py) the sums per step. After backward they are synchronous (exposed =
total); overlapped, a bucket's sum runs from its hook during the last micro-batch's backward to
`sync`. The two runs' losses must be equal (bit for bit: the same buckets sum the same numbers).

Prints one JSON object (rank 0): per setting the medians over the steps after --warmup of step
ms, and per bucket kind (dense, expert) and for both the replica sums' exposed ms and total ms
(the sum of each bucket's; overlapped spans add up), their bytes per step, the buckets started
during backward; the losses' equality; the machine (CPU model, load average at the start and the end).
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_moe.config import load_config  # noqa: E402
from megatron_moe.distributed import collectives as C  # noqa: E402
from megatron_moe.distributed.rank_timing import init_state  # noqa: E402
from megatron_moe.perf import timing  # noqa: E402
from megatron_moe.perf.machine import load_average, machine_info  # noqa: E402
from megatron_moe.training.trainer import Trainer  # noqa: E402

SHAPE = ["model.num_layers=4", "model.hidden_size=256", "model.ffn_hidden_size=1024", "moe.expert_ffn_hidden_size=512",
         "model.seq_length=128", "training.micro_batch_size=2", "training.global_batch_size=8",
         "optimizer.grad_bucket_mb=1", "training.eval_interval=0", "logging.tensorboard=false"]
KINDS = ("all_reduce", "grad_reduce_scatter")  # GradSync's bucket sums, ZeRO-1's reduce-scatters
KEYS = {"dense": [f"{k}/{g}" for k in KINDS for g in ("dp", "dp_side")],
        "expert": [f"{k}/{g}" for k in KINDS for g in ("edp", "edp_side")]}


def _sums(stats) -> list:
    """[exposed, total] Durations per bucket kind, then for both (COMM_STATS.exposed / .seconds)."""
    parts = [[stats.exposed.get(k, 0.0) for k in keys] + [stats.seconds.get(k, 0.0) for k in keys]
             for keys in KEYS.values()]
    n = len(KEYS["dense"])
    return parts + [parts[0][:n] + parts[1][:n] + parts[0][n:] + parts[1][n:]]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="dotted config overrides of both runs")
    p.add_argument("--config", default="configs/gpt_moe_tiny.yaml")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    return p.parse_args(argv)


def trainer_for(args, state, overlap: bool, tmp: str) -> Trainer:
    cfg = load_config(args.config, SHAPE + [f"training.train_iters={args.steps}", f"training.run_dir={tmp}/{overlap}",
                                            f"optimizer.overlap_grad_reduce={str(overlap).lower()}"]
                      + list(args.overrides))
    trainer = Trainer(cfg, state)
    sync, sums = trainer.grads.sync, []
    trainer.dp_sums = sums

    def timed_sync():  # the replica sums' exposed and total time of this step: Durations, read after the loop
        before = _sums(C.COMM_STATS)  # (reading them in the timed step would make the host wait for
        sync()  # the buckets' events on a GPU)
        sums.append((before, _sums(C.COMM_STATS)))

    trainer.grads.sync = timed_sync
    return trainer


def main(argv=None) -> int:
    args = parse_args(argv)
    state = init_state(1, 1, 1, side_channels=["dp", "edp"])
    if state.dp_size < 2:
        print("run on >= 2 data-parallel processes (torchrun --nproc_per_node 2 benchmarks/grad_overlap.py)",
              file=sys.stderr)
        return 2
    machine = machine_info()
    rows = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {overlap: trainer_for(args, state, overlap, tmp) for overlap in (False, True)}
        for iteration in range(1, args.steps + 1):
            for overlap, trainer in trainers.items():
                watch = timing.Stopwatch(trainer.device)
                record = trainer.train_step(iteration)
                nbytes = [sum(C.COMM_STATS.bytes.get(k, 0) for k in keys) for keys in KEYS.values()]
                rows[overlap].append((watch.seconds(), trainer.dp_sums[-1], nbytes + [sum(nbytes)],
                                      trainer.grads.started_in_backward, len(trainer.grads.launch_order),
                                      record["loss"]))

    def seconds(before, after):  # [exposed, total] s per kind: the Durations, read once the steps are done
        half = len(before) // 2
        return [sum(float(a) - float(b) for a, b in zip(after[i:i + half], before[i:i + half])) for i in (0, half)]

    rows = {overlap: [(t, [seconds(b, a) for b, a in zip(*sums)], *rest) for t, sums, *rest in steps]
            for overlap, steps in rows.items()}
    if state.rank != 0:
        return 0

    def summary(steps):
        kept = steps[args.warmup:]
        ms = lambda f: round(statistics.median(f(s) for s in kept) * 1e3, 2)  # noqa: E731
        out = {"step_ms": ms(lambda s: s[0])}
        for i, name in enumerate(list(KEYS) + ["all"]):
            out[name] = {"exposed_ms": ms(lambda s: s[1][i][0]), "total_ms": ms(lambda s: s[1][i][1]),
                         "bytes": kept[-1][2][i]}
        return {**out, "buckets_started_in_backward": f"{kept[-1][3]} of {kept[-1][4]}",
                "losses": [s[5] for s in steps]}

    out = {name: summary(rows[overlap]) for name, overlap in (("off", False), ("on", True))}
    print(json.dumps({
        "config": {"config": args.config, "processes": state.world_size, "steps": args.steps, "warmup": args.warmup,
                   "overrides": SHAPE + list(args.overrides)},
        "machine": dict(machine, load_average=[machine["load_average"], load_average()]),
        **out, "losses_equal": out["off"]["losses"] == out["on"]["losses"],
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
