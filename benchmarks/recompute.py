"""Activation recomputation (`training.recompute`: none, selective, full) side by side: step time,
peak memory and the loss of the same single-process training step (issue #16).

    python benchmarks/recompute.py
    python benchmarks/recompute.py model.dropout=0.1 --steps 4

The model is `--config` (default configs/mixtral_tiny.yaml) with the Mixtral-shaped shapes of
benchmarks/train_throughput.py, changed by dotted overrides. Each level runs in its own process
(peak memory does not go down within one): it builds the model from the seed, runs `--steps`
forward + backward steps on the same tokens (gradients zeroed in between), and reports the median
step ms, the peak resident memory of the process (`ru_maxrss`) and that peak above the memory
after the model was built (the activations, mostly), and the first step's loss and grad norm
(the levels must agree: recomputation is exact). Prints one JSON object.
"""
import argparse
import json
import resource
import statistics
import subprocess
import sys

LEVELS = ("none", "selective", "full")
SHAPE = ["model.num_layers=4", "model.hidden_size=256", "model.ffn_hidden_size=512", "model.num_attention_heads=4",
         "moe.expert_ffn_hidden_size=512", "moe.num_experts=8", "moe.top_k=2", "model.vocab_size=1024",
         "model.seq_length=256", "training.micro_batch_size=8", "moe.capacity_factor=null"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="dotted config overrides on top of the shape")
    p.add_argument("--config", default="configs/mixtral_tiny.yaml")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--level", choices=LEVELS, help=argparse.SUPPRESS)  # one level, in this process
    return p.parse_args(argv)


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def run_level(args) -> dict:
    import torch

    from megatron_moe.config import load_config, validate_config
    from megatron_moe.distributed.parallel_state import ParallelState
    from megatron_moe.model.gpt import GPTMoEModel
    from megatron_moe.perf import timing

    torch.set_num_threads(1)
    cfg = load_config(args.config, SHAPE + list(args.overrides) + [f"training.recompute={args.level}"])
    validate_config(cfg, 1)
    model = GPTMoEModel(cfg, ParallelState.single_process())
    model.train()
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.training.micro_batch_size, cfg.model.seq_length),
                           generator=torch.Generator().manual_seed(0))
    built = _rss_mb()
    times, first = [], None
    for _ in range(args.steps):
        model.zero_grad(set_to_none=True)
        with timing.wall(tokens.device) as took:
            out = model(tokens, labels=tokens)
            (out.lm_loss + out.aux_loss).backward()
        times.append(took.seconds * 1e3)
        if first is None:
            norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None))
            first = (float(out.lm_loss.detach()), float(norm))
    peak = _rss_mb()
    return {"step_ms": round(statistics.median(times), 1), "peak_rss_mb": round(peak, 1),
            "peak_over_model_mb": round(peak - built, 1), "loss": first[0], "grad_norm": first[1]}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.level:
        print(json.dumps(run_level(args)), flush=True)
        return 0
    results = {}
    for level in LEVELS:
        cmd = [sys.executable, __file__, "--config", args.config, "--steps", str(args.steps), "--level", level,
               *args.overrides]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results[level] = json.loads(out.strip().splitlines()[-1])
        print(f"{level:10s} {results[level]['step_ms']:9.1f} ms  peak {results[level]['peak_rss_mb']:8.1f} MB "
              f"(+{results[level]['peak_over_model_mb']:.1f} over the model)", file=sys.stderr, flush=True)
    base = results["none"]
    results["max_rel_loss_diff"] = max(abs(r["loss"] - base["loss"]) / abs(base["loss"]) for r in
                                       (results[level] for level in LEVELS))
    results["max_rel_grad_norm_diff"] = max(abs(r["grad_norm"] - base["grad_norm"]) / base["grad_norm"] for r in
                                            (results[level] for level in LEVELS))
    print(json.dumps({"config": vars(args), "results": results}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
