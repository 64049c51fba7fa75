"""Lancet at model level: one GPT-MoE forward + backward plain, with `moe.lancet.defer_wgrad`
(§4), with `moe.lancet.partitions` (§5) and with both, side by side (issue #12).

    torchrun --nproc_per_node 2 benchmarks/lancet.py --expert 2
    torchrun --nproc_per_node 2 benchmarks/lancet.py --expert 2 --partitions 4 --partition-range 2
    torchrun --nproc_per_node 4 benchmarks/lancet.py --tensor 2 --expert 2 --expert-shard 2 moe.schedule=s2 moe.saa=true

Every model is `--config` (default configs/gpt_moe_tiny.yaml, changed by dotted overrides) on the
given layout, built from the same seed, and gets the same tokens (each data-parallel rank its
own). Steps alternate (plain, defer_wgrad, partitions, both, plain, ...); a step's time is the
slowest rank's. Reported per variant: median step ms; the token all-to-alls' exposed (waited) and
total (issue to completion) time in backward and in forward, rank 0's medians; with defer_wgrad
the dW time that ran while a backward all-to-all was in flight and the dW time left for the end of
backward (`WGradScheduler.overlapped_seconds` / `drained_seconds`); with partitions the segments
run partitioned (and, for `--partition-range auto`, the dynamic program's predicted forward); and
the largest difference of any variant's gradients from the plain model's (same math: float
rounding). Prints one JSON object on rank 0's last line.
"""
import argparse
import json
import statistics
import sys

import torch

from megatron_moe.config import load_config
from megatron_moe.distributed import collectives as C
from megatron_moe.model.gpt import GPTMoEModel
from megatron_moe.moe.schedules import A2A_KINDS
from megatron_moe.distributed.rank_timing import init_state, slowest_rank_seconds


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="dotted config overrides")
    p.add_argument("--config", default="configs/gpt_moe_tiny.yaml")
    p.add_argument("--tensor", type=int, default=1)
    p.add_argument("--expert", type=int, default=1)
    p.add_argument("--expert-shard", type=int, default=1)
    p.add_argument("--batch", type=int, default=4, help="sequences per data-parallel rank")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--partitions", type=int, default=2, help="moe.lancet.partitions of the partitioned variants")
    p.add_argument("--partition-range", default="1", help="moe.lancet.partition_range: auto | N")
    p.add_argument("--variants", default="plain,defer_wgrad,partitions,both",
                   help="comma-separated subset of plain, defer_wgrad, partitions, both (plain always runs)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    state = init_state(args.tensor, args.expert, args.expert_shard)
    torch.set_num_threads(1)
    layout = [f"parallel.tensor={args.tensor}", f"parallel.expert={args.expert}",
              f"parallel.expert_shard={args.expert_shard}", "model.dropout=0.0", "logging.tensorboard=false"]
    partitioned = [f"moe.lancet.partitions={args.partitions}", f"moe.lancet.partition_range={args.partition_range}"]
    variants = {"plain": [], "defer_wgrad": ["moe.lancet.defer_wgrad=true"], "partitions": partitioned,
                "both": ["moe.lancet.defer_wgrad=true"] + partitioned}
    wanted = ["plain"] + [v for v in args.variants.split(",") if v in variants and v != "plain"]
    models = {}
    for name in wanted:
        cfg = load_config(args.config, layout + list(args.overrides) + variants[name])
        models[name] = GPTMoEModel(cfg, state)
    gen = torch.Generator().manual_seed(1234 + state.dp.rank)
    tokens = torch.randint(0, cfg.model.vocab_size, (args.batch, cfg.model.seq_length), generator=gen)
    times = {name: [] for name in models}
    comm = {name: [] for name in models}
    wgrad = {name: {"overlapped": [], "drained": []} for name in models}
    schedulers = {name: next((m.wgrad for m in model.modules() if getattr(m, "wgrad", None) is not None), None)
                  for name, model in models.items()}

    def step(name):
        model = models[name]
        model.zero_grad(set_to_none=True)
        C.COMM_STATS.reset()
        scheduler = schedulers[name]
        if scheduler is not None:
            scheduler.overlapped_seconds = scheduler.drained_seconds = 0.0
        out = model(tokens, labels=tokens)
        with C.backward_phase():
            (out.lm_loss + out.aux_loss).backward()
        comm[name].append(C.COMM_STATS.seconds_by_phase(A2A_KINDS, resolve=False))  # read after the step
        if scheduler is not None:
            wgrad[name]["overlapped"].append(scheduler.overlapped_seconds)  # Durations: read after the step
            wgrad[name]["drained"].append(scheduler.drained_seconds)

    for rep in range(args.warmup + args.reps):
        for name in models:
            seconds = slowest_rank_seconds(lambda: step(name), state)
            if rep >= args.warmup:
                times[name].append(seconds * 1e3)
    plain = dict(models["plain"].named_parameters())
    diff = max((float((p.grad - plain[n].grad).abs().max()) for m in models.values()
                for n, p in m.named_parameters() if p.grad is not None), default=0.0)
    diff = float(C.all_reduce(state.world.to_device(torch.tensor([diff], dtype=torch.float64)), state.world, op="max"))

    def median_ms(values):
        return round(statistics.median(float(v) for v in values[args.warmup:] or values) * 1e3, 3)

    results = {}
    for name in models:
        results[name] = {"ms_median": round(statistics.median(times[name]), 3)}
        for part in ("exposed", "total"):
            for phase in ("backward", "forward"):
                results[name][f"a2a_{part}_ms_{phase}"] = median_ms([c[part][phase] for c in comm[name]])
        if schedulers[name] is not None:
            results[name].update({"wgrad_overlapped_ms": median_ms(wgrad[name]["overlapped"]),
                                  "wgrad_at_end_ms": median_ms(wgrad[name]["drained"])})
        partitioner = models[name].partitioners[0]  # one pipeline stage: one model chunk
        if partitioner is not None:
            results[name]["segments"] = [[s.start, s.end, s.parts] for s in partitioner.segments]
            if partitioner.prediction is not None:
                results[name]["predicted"] = partitioner.prediction
    results["max_abs_grad_diff"] = diff
    if state.rank == 0:
        for name in models:
            r = results[name]
            print(f"{name:12s} {r['ms_median']:9.2f} ms  a2a exposed / total: forward {r['a2a_exposed_ms_forward']:.2f}"
                  f" / {r['a2a_total_ms_forward']:.2f} ms, backward {r['a2a_exposed_ms_backward']:.2f} / "
                  f"{r['a2a_total_ms_backward']:.2f} ms", flush=True)
        print(json.dumps({"config": dict(vars(args), world_size=state.world_size), "results": results}), flush=True)
    C.destroy_process_group(state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
