"""One training step, single process: megatron_moe vs Hugging Face `transformers.MixtralForCausalLM`
on the same Mixtral-shaped model and weights, and the step's pure matmul time (issue #16).

    python benchmarks/train_throughput.py
    python benchmarks/train_throughput.py model.num_layers=2 training.micro_batch_size=4 --steps 6
    python benchmarks/train_throughput.py --precision bf16
    python benchmarks/train_throughput.py --precision bf16 --no-compile --steps 5 --warmup 3   # GPU smoke run

The model is `configs/mixtral_tiny.yaml` with the issue's shape (4 layers, hidden 256, 4 heads,
expert FFN 512, 8 experts top-2, vocab 1024, seq 256, micro-batch 8, dropless, fp32), changed by
any dotted overrides given. Ours is built as training builds it (`GPTMoEModel`, `build_optimizer`:
AdamW); HF's from our initial weights written as a Mixtral directory (`convert/hf_common.write_hf`)
and loaded by `from_pretrained`, AdamW (torch's default implementation) with the same
hyper-parameters. Both get the same random tokens; the first step's losses are compared
(`loss_diff`: the models compute the same function, so this is float rounding plus the aux loss,
which only ours adds: both losses below are the language-model loss).

A step is zero_grad, forward, backward (LM loss + ours: its aux loss), optimizer step. Steps
alternate in rounds (ours, ours with `training.compile=true`, HF, ..., the floor pass; the next
round in reverse order), --warmup rounds first; reported: median step ms, tokens/s, and the
ratios to HF and of compiled to eager, each the median over rounds of that round's ratio (a slow
phase of the machine that spans a round cancels; on a shared 2-core VM whole runs differ by up
to 30 %); the first compiled step, which compiles, apart as `compile_first_step_s`; parameter
counts of both (they must be equal); and `matmul_floor_ms`: the time of the step's matrix
multiplies alone (every forward GEMM of the model at its shapes, experts with the rows the first
step routed to each, plus the two backward GEMMs of each) as plain `torch.mm` / `torch.bmm` calls,
one pass per round (median). Prints one JSON object, with `machine`: CPU model, cores, torch
version and threads, CUDA device, and the load average at the start and the end (other jobs on
the cores slow every side, not always alike). The ratios depend on the machine. glibc's malloc
keeps freed memory in the process for all sides, as training sets it (perf/host_memory.py).

--precision bf16 (issue #29, docs/precision.md): ours is `training.precision=bf16` (bf16 weights,
fp32 main gradients and master weights: `MixedPrecisionAdamW`), compiled too; next to it, in the
same rotation, ours in fp32 (`ours_fp32`), HF in fp32 (`hf`), HF under `torch.autocast` bf16
with fp32 weights (`hf_autocast`) and HF loaded in bf16 with AdamW on the bf16 weights
(`hf_bf16`), all from the same initial weights, and, unless --no-compile, ours compiled in fp32
(`ours_fp32_compiled`); the floor's GEMMs run in bf16 (`matmul_floor_ms`, measured as the fp32
one). Ratios: `ours_vs_floor` (step / floor), and the speedups (> 1: ours faster)
`ours_vs_best_hf_bf16` (against the faster of HF's two bf16 options in each round; also
`ours_compiled_vs_best_hf_bf16`), `ours_vs_hf` (HF fp32), `ours_vs_ours_fp32` (eager against
eager) and `ours_compiled_vs_ours_fp32_compiled` (compiled against compiled).

Warm-up: on the CPU, oneDNN JIT-compiles a bf16 GEMM kernel for each new shape (3-5 ms each;
`moe/grouped_gemm.py`), and the experts' row counts (rounded to buckets of 32) keep taking new
values during the first ~10-20 steps, as the routing moves: in a trace of one bf16 process, the
steps after 1, 2, 3 warm-up steps still compiled 66, 52, 6 new GEMM shapes (113, 113, 13 ms), and
steps 5-16 compiled 0-18 (0-60 ms). Training amortizes that over its thousands of steps, the floor
(fixed shapes) pays it once, so the default 8 warm-up rounds (16 steps of ours, eager and compiled
sharing the kernel cache) measure the steady state; HF's bf16 experts, whose row counts vary too,
get the same rounds.

Device: `--device` (default: the GPU when CUDA is available, else the CPU); every side, the
floor and the tokens run there (`machine.cuda_device` names the GPU).

MFU (model FLOPs utilization, issue #44): `model_flops.flops_per_token` = 6 x the weights one token
multiplies through (`active_gemm_params`: an MoE layer's experts at top_k of them, not all; the
embedding lookups, norms and biases do no GEMM) + Megatron-LM's attention term (scores and
context, 12 s h_q per layer forward and backward, halved for the causal mask as current
Megatron-LM's `num_floating_point_operations` does; older versions did not halve); `mfu` per side = flops_per_token x tokens/s / peak FLOP/s.
The peak is bf16 dense tensor-core FLOP/s by GPU name (`PEAK_BF16_TFLOPS`), or `--peak-tflops`;
on the CPU, an unknown GPU or a fp32 run without `--peak-tflops` every `mfu` is null and
`model_flops.mfu_null_reason` says why. Every side runs the same model, so all share the FLOPs;
fp32 sides are measured against the same bf16 peak.

`peak_mb`: per side, the peak of the bytes held by tensors during one step (weights, gradients,
optimizer state and activations; torch's profiler's allocation events on the CPU, the CUDA
allocator's peak on a GPU), the one process being the one rank; `peak_vs_fp32` is ours over
ours_fp32 (bf16). Activations dominate it at larger micro-batches (`training.micro_batch_size=32`).
"""
import argparse
import json
import statistics
import sys
import tempfile
from typing import Optional, Tuple

import torch

from megatron_moe.config import load_config
from megatron_moe.convert.hf_common import write_hf
from megatron_moe.convert.hf_mixtral import MIXTRAL
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.gpt import GPTMoEModel
from megatron_moe.tensor_parallel.param_meta import init_model_from_seed_
from megatron_moe.model.precision import cast_params_, param_dtype
from megatron_moe.perf import timing
from megatron_moe.perf.host_memory import keep_freed_host_memory
from megatron_moe.perf.machine import load_average, machine_info
from megatron_moe.training.optimizer import build_optimizer

SHAPE = ["model.num_layers=4", "model.hidden_size=256", "model.ffn_hidden_size=512", "model.num_attention_heads=4",
         "moe.expert_ffn_hidden_size=512", "moe.num_experts=8", "moe.top_k=2", "model.vocab_size=1024",
         "model.seq_length=256", "training.micro_batch_size=8", "moe.capacity_factor=null",
         "training.precision=fp32", "logging.tensorboard=false"]
# bf16 dense tensor-core peak, TFLOP/s, by a part of `torch.cuda.get_device_name()` (NVIDIA's
# datasheets, dense = half the "with sparsity" figure); the first match wins: PCIe / NVL parts first
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200 NVL", 835.0), ("H100", 989.0),
                    ("H200", 989.0), ("A100", 312.0))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="dotted config overrides on top of the issue's shape")
    p.add_argument("--config", default="configs/mixtral_tiny.yaml")
    p.add_argument("--steps", type=int, default=10, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=8,
                   help="untimed rounds first (bf16 on the CPU: until the experts' GEMM shapes are compiled, "
                        "module docstring)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: ours in bf16 against HF's bf16 options and both in fp32 (module docstring)")
    p.add_argument("--no-compile", action="store_true", help="leave out the compiled side")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where every side runs (default: the GPU when CUDA is available)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's peak TFLOP/s for MFU (default: PEAK_BF16_TFLOPS by GPU name, bf16 only)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.exit(2, "train_throughput.py: error: --device cuda, but no CUDA GPU is visible (use --device cpu)\n")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        p.exit(2, f"train_throughput.py: error: --peak-tflops must be > 0, got {args.peak_tflops}\n")
    return args


def active_gemm_params(model, cfg) -> int:
    """Weights one token multiplies through in one forward (the N of MFU's 6 N): every matrix of
    the model but the embedding lookups (the word embedding counts when tied: it is then the output
    layer), an expert stack [E, ...] at top_k of its E experts; vectors (norms, biases, a vector
    per expert) do no GEMM."""
    total = 0
    for name, p in model.named_parameters():
        expert = p.meta.kind == "expert"
        if p.dim() - expert < 2:
            continue
        if name.startswith("embedding.") and not (cfg.model.tie_embeddings and name == "embedding.word.weight"):
            continue
        total += p.numel() // p.shape[0] * cfg.moe.top_k if expert else p.numel()
    return total


def flops_per_token(model, cfg) -> int:
    """Model FLOPs of one token's forward and backward: 6 N (2 per multiply-add, forward, dX and dW)
    + Megatron-LM's attention scores and context: 2 GEMMs of s x h_q per layer, x 2 x 3, halved for
    the causal mask -> 6 L s h_q."""
    m = cfg.model
    h_q = m.num_attention_heads * (m.head_dim or m.hidden_size // m.num_attention_heads)
    return 6 * active_gemm_params(model, cfg) + 6 * m.num_layers * m.seq_length * h_q


def peak_tflops(device_name: Optional[str], precision: str,
                override: Optional[float]) -> Tuple[Optional[float], Optional[str]]:
    """(peak TFLOP/s of the device, None) or (None, why there is none). `device_name`: the CUDA
    device's name, None on the CPU; `override`: --peak-tflops."""
    if override is not None:
        return override, None
    if device_name is None:
        return None, "no peak FLOP/s for the CPU: pass --peak-tflops"
    if precision != "bf16":
        return None, f"the peak table is bf16 dense FLOP/s, this run is {precision}: pass --peak-tflops"
    for part, tflops in PEAK_BF16_TFLOPS:
        if part in device_name:
            return tflops, None
    return None, f"no peak FLOP/s known for {device_name!r}: pass --peak-tflops"


def mfu(flops: int, tokens_per_sec: float, peak: Optional[float]) -> Optional[float]:
    """Model FLOPs utilization: flops per token x tokens/s over the peak (TFLOP/s); None without a peak."""
    return None if peak is None else float(f"{flops * tokens_per_sec / (peak * 1e12):.4g}")


def build_ours(cfg, device):
    model = GPTMoEModel(cfg, ParallelState.single_process())
    init_model_from_seed_(model, cfg.training.seed, ParallelState.single_process())
    cast_params_(model.to(device), cfg.training.precision)  # bf16: as the trainer does (model/precision.py)
    return model, build_optimizer(model, cfg.optimizer, compiled=cfg.training.compile)


def build_hf(cfg, ours, device, dtype=torch.float32):
    import transformers

    with tempfile.TemporaryDirectory() as tmp:  # through HF's loader, which maps the checkpoint layout
        weights = {n: p.detach().float().cpu() for n, p in ours.named_parameters()}
        write_hf(tmp, MIXTRAL, cfg, weights, lambda i: weights)
        hf = transformers.MixtralForCausalLM.from_pretrained(tmp, dtype=dtype).to(device)
    hf.train()
    o = cfg.optimizer
    decay = [p for n, p in hf.named_parameters() if p.dim() >= 2 and "norm" not in n]
    rest = [p for n, p in hf.named_parameters() if not (p.dim() >= 2 and "norm" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                                   {"params": rest, "weight_decay": 0.0}], lr=o.lr,
                                  betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)
    return hf, optimizer


def step_ours(model, optimizer, tokens, labels):
    optimizer.zero_grad(set_to_none=True)
    out = model(tokens, labels)
    (out.lm_loss + out.aux_loss).backward()
    optimizer.step()
    return out.lm_loss.item()


def step_hf(model, optimizer, tokens, labels):
    optimizer.zero_grad(set_to_none=True)
    logits = model(input_ids=tokens).logits  # [b, s, V]
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    loss.backward()
    optimizer.step()
    return loss.item()


def step_hf_autocast(model, optimizer, tokens, labels):
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16):
        logits = model(input_ids=tokens).logits
    optimizer.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    loss.backward()
    optimizer.step()
    return loss.item()


def peak_bytes(step, model, optimizer, tokens, labels) -> int:
    """Peak bytes held by tensors during one `step` of this side: what the model and optimizer hold
    before it (parameters, optimizer state, main gradients), plus the peak of the step's allocations
    minus frees (profiler memory events on the CPU; on a GPU the allocator's peak above what was
    allocated before the step, so the other sides' tensors on the same GPU do not count)."""
    optimizer.zero_grad(set_to_none=True)
    main_grads = getattr(getattr(optimizer, "main_grads", None), "buffers", [])
    held = [*model.parameters(), *main_grads,
            *[v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}
    if tokens.device.type == "cuda":
        before = torch.cuda.memory_allocated(tokens.device)
        torch.cuda.reset_peak_memory_stats(tokens.device)
        step(model, optimizer, tokens, labels)
        return sum(storages.values()) + torch.cuda.max_memory_allocated(tokens.device) - before
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step(model, optimizer, tokens, labels)
    running = peak = 0  # allocations are the ops' own (self) usage, frees "[memory]" events
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        running += e.self_cpu_memory_usage
        peak = max(peak, running)
    return sum(storages.values()) + peak


def matmul_floor(cfg, rows_per_expert, dtype=torch.float32, device="cpu"):
    """One pass over the step's GEMMs alone (forward, and dX / dW of each in backward), in `dtype`:
    a function returning the seconds they took, to be timed in turn with the steps."""
    m, b = cfg.model, cfg.training.micro_batch_size
    n, h, s, heads = b * m.seq_length, m.hidden_size, m.seq_length, m.num_attention_heads
    d, f, V = h // heads, cfg.moe.expert_ffn_hidden_size, m.vocab_size
    dense = [(n, h, 3 * h), (n, h, h), (n, h, cfg.moe.num_experts)]  # qkv, proj, router: [m, k] @ [k, n]
    experts = [(rows, h, 2 * f) for rows in rows_per_expert] + [(rows, f, h) for rows in rows_per_expert]
    gemms = (dense + experts) * m.num_layers + [(n, h, V)]
    batched = [(b * heads, s, d, s), (b * heads, s, s, d)] * m.num_layers  # scores, context

    def run() -> float:
        run.seconds = 0.0
        for rows, k, cols in gemms:
            if rows == 0:
                continue
            x, w, dy = (torch.randn(shape, dtype=dtype, device=device)
                        for shape in ((rows, k), (k, cols), (rows, cols)))
            with timing.wall(x.device) as took:
                x @ w, dy @ w.t(), x.t() @ dy  # forward, dX, dW
            run.seconds += took.seconds
        for g, rows, k, cols in batched:
            x, w, dy = (torch.randn(shape, dtype=dtype, device=device)
                        for shape in ((g, rows, k), (g, k, cols), (g, rows, cols)))
            with timing.wall(x.device) as took:
                torch.bmm(x, w), torch.bmm(dy, w.transpose(1, 2)), torch.bmm(x.transpose(1, 2), dy)
            run.seconds += took.seconds
        return run.seconds

    return run


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    keep_freed_host_memory()  # as training does (perf/host_memory.py), for every side, HF's included
    machine = machine_info()  # load average at the start; the JSON adds the one at the end
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise SystemExit("benchmarks/train_throughput.py needs transformers (pip install transformers)")
    overrides = SHAPE + list(args.overrides) + [f"training.precision={args.precision}"]
    cfg = load_config(args.config, overrides)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    ours, ours_opt = build_ours(cfg, device)
    hf, hf_opt = build_hf(cfg, ours, device)
    count = lambda model: sum(p.numel() for p in model.parameters())  # noqa: E731
    if count(ours) != count(hf):
        raise SystemExit(f"parameter counts differ: ours {count(ours):,}, HF {count(hf):,}")
    sides = {"ours": (ours, ours_opt, step_ours)}
    if not args.no_compile:
        sides["ours_compiled"] = (*build_ours(load_config(args.config, overrides + ["training.compile=true"]), device),
                                  step_ours)
    sides["hf"] = (hf, hf_opt, step_hf)
    if args.precision == "bf16":  # the same initial weights in every side (ours: bf16-rounded, fp32 masters)
        sides["ours_fp32"] = (*build_ours(load_config(args.config, overrides + ["training.precision=fp32"]), device),
                              step_ours)
        if not args.no_compile:
            sides["ours_fp32_compiled"] = (*build_ours(load_config(
                args.config, overrides + ["training.precision=fp32", "training.compile=true"]), device), step_ours)
        sides["hf_autocast"] = (*build_hf(cfg, ours, device), step_hf_autocast)
        sides["hf_bf16"] = (*build_hf(cfg, ours, device, torch.bfloat16), step_hf)
    b, s = cfg.training.micro_batch_size, cfg.model.seq_length
    tokens = torch.randint(0, cfg.model.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(args.seed))
    tokens, labels = tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)
    first, compile_seconds = {}, None
    for side, (model, opt, step) in sides.items():
        with timing.wall(tokens.device) as took:
            first[side] = step(model, opt, tokens, labels)
        if side == "ours_compiled":
            compile_seconds = took.seconds
    rows_per_expert = [int(r) for r in sum(st.tokens_per_expert for st in
                                           (layer.ffn.last_stats for layer in ours.layers)) // cfg.model.num_layers]
    peak = {side: peak_bytes(step, model, opt, tokens, labels) / 2 ** 20 for side, (model, opt, step) in sides.items()}
    floor_pass = matmul_floor(cfg, rows_per_expert, param_dtype(args.precision), device)
    times = {side: [] for side in [*sides, "floor"]}
    for i in range(args.warmup + args.steps):
        order = [*sides, "floor"]  # the floor in turn with the steps, so the ratios see the same load
        for side in order if i % 2 == 0 else reversed(order):  # reversed every other round: drift cancels
            if side == "floor":
                seconds = floor_pass()
            else:
                model, opt, step = sides[side]
                with timing.wall(tokens.device) as took:
                    step(model, opt, tokens, labels)
                seconds = took.seconds
            if i >= args.warmup:
                times[side].append(seconds)
        print(f"step {i + 1}/{args.warmup + args.steps}", file=sys.stderr, flush=True)
    ms = {side: statistics.median(t) * 1e3 for side, t in times.items()}
    floor = ms.pop("floor")

    def paired(slow, fast) -> float:
        """Median over rounds of the round's time ratio slow / fast (`slow`: a side or a list of
        sides, the fastest of them each round)."""
        slow = slow if isinstance(slow, list) else [slow]
        return round(statistics.median(min(times[s][r] for s in slow) / times[fast][r]
                                       for r in range(args.steps)), 3)

    ratios = {"ours_vs_hf": paired("hf", "ours")}
    if "ours_compiled" in ms:
        ratios.update({"ours_compiled_vs_hf": paired("hf", "ours_compiled"),
                       "compiled_vs_eager": paired("ours", "ours_compiled"),
                       "compiled_vs_floor": paired("ours_compiled", "floor"),
                       "compile_first_step_s": round(compile_seconds, 1)})
    if args.precision == "bf16":
        ratios.update({"ours_vs_best_hf_bf16": paired(["hf_autocast", "hf_bf16"], "ours"),
                       "ours_vs_ours_fp32": paired("ours_fp32", "ours"),
                       "peak_vs_fp32": round(peak["ours"] / peak["ours_fp32"], 3)})
        if "ours_compiled" in ms:
            ratios.update({"ours_compiled_vs_best_hf_bf16": paired(["hf_autocast", "hf_bf16"], "ours_compiled"),
                           "ours_compiled_vs_ours_fp32_compiled": paired("ours_fp32_compiled", "ours_compiled")})
    tokens_per_sec = {k: round(b * s / v * 1e3, 1) for k, v in ms.items()}
    flops = flops_per_token(ours, cfg)
    peak_flops, why = peak_tflops(machine["cuda_device"] if device.type == "cuda" else None, args.precision,
                                  args.peak_tflops)
    print(json.dumps({
        "config": {"overrides": overrides, "steps": args.steps, "warmup": args.warmup, "device": str(device),
                   "torch": torch.__version__, "transformers": transformers.__version__},
        "machine": dict(machine, load_average=[machine["load_average"], load_average()]),
        "parameters": {"ours": count(ours), "hf": count(hf)},
        "first_step_lm_loss": first, "loss_diff": abs(first["ours"] - first["hf"]),
        **({"compiled_loss_diff": abs(first["ours"] - first["ours_compiled"])} if "ours_compiled" in first else {}),
        "step_ms": {k: round(v, 1) for k, v in ms.items()},
        "tokens_per_sec": tokens_per_sec,
        "mfu": {k: mfu(flops, v, peak_flops) for k, v in tokens_per_sec.items()},
        "model_flops": {"active_params": active_gemm_params(ours, cfg), "flops_per_token": flops,
                        "peak_tflops": peak_flops, "mfu_null_reason": why},
        "peak_mb": {k: round(v, 1) for k, v in peak.items()},
        **ratios,
        "matmul_floor_ms": round(floor, 1), "ours_vs_floor": paired("ours", "floor")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
