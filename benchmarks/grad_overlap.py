"""Data-parallel gradient reduction overlapped with backward (`optimizer.overlap_grad_reduce`,
issue #44 item 6) against the reduction after backward, on data-parallel processes:

    torchrun --nproc_per_node 2 benchmarks/grad_overlap.py                    # 12 steps each, 2 warm-up
    torchrun --nproc_per_node 2 benchmarks/grad_overlap.py --steps 20 optimizer.grad_bucket_mb=4

Two trainers of the same config (`--config` plus the default shape overrides below, then the
command line's), one per setting, step in turn (`off`, `on`, `off`, ...) so both see the same
machine load. Per step: the wall time (`perf/timing.py` Stopwatch), and of the gradient sums over
``dp`` (COMM_STATS' "all_reduce/dp" around `sync`: every dense bucket, each op's *exposed* time,
the issue call plus the wait, and *total*, issue to completion; the collectives' accounting,
distributed/collectives.py) the sums per step. After backward they are synchronous (exposed =
total); overlapped, a bucket's sum runs from its hook during the last micro-batch's backward to
`sync`. The two runs' losses must be equal (bit for bit: the same buckets sum the same numbers).

Prints one JSON object (rank 0): per setting the medians over the steps after --warmup of step
ms, dp-sum exposed ms and total ms (the sum of each bucket's; overlapped spans add up), the step's
"all_reduce/dp" bytes (the loss mean's 24 included), the buckets started during backward; the
losses' equality; the machine (CPU model, load average at the start and the end).
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
KEY = "all_reduce/dp"


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

    def timed_sync():  # the dp sums' exposed and total time of this step: Durations, read after the loop
        exposed, total = C.COMM_STATS.exposed[KEY], C.COMM_STATS.seconds[KEY]  # (reading them in the
        sync()  # timed step would make the host wait for the buckets' events on a GPU)
        sums.append((exposed, C.COMM_STATS.exposed[KEY], total, C.COMM_STATS.seconds[KEY]))

    trainer.grads.sync = timed_sync
    return trainer


def main(argv=None) -> int:
    args = parse_args(argv)
    state = init_state(1, 1, 1, side_channels=["dp"])
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
                rows[overlap].append((watch.seconds(), trainer.dp_sums[-1], C.COMM_STATS.bytes[KEY],
                                      trainer.grads.started_in_backward, record["loss"]))
    rows = {overlap: [(t, float(e1) - float(e0), float(t1) - float(t0), *rest) for t, (e0, e1, t0, t1), *rest in steps]
            for overlap, steps in rows.items()}  # the dp sums' seconds, read once the steps are done
    if state.rank != 0:
        return 0

    def summary(steps):
        kept = steps[args.warmup:]
        ms = lambda j: round(statistics.median(s[j] for s in kept) * 1e3, 2)  # noqa: E731
        return {"step_ms": ms(0), "dp_sum_exposed_ms": ms(1), "dp_sum_total_ms": ms(2), "dp_sum_bytes": kept[-1][3],
                "buckets_started_in_backward": kept[-1][4], "losses": [s[5] for s in steps]}

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
