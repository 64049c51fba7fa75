"""Greedy generation: ours (megatron_moe/generation.py, KV cache) against transformers' `generate`
on the same model, side by side (issue #46; docs/performance.md "Generation").

    python benchmarks/generate.py [--hidden 256 --layers 4 --experts 8 --batch 4 --prompt-len 64
                                   --new-tokens 64 --repeats 5 --threads 2 --device cpu]

A random Mixtral-shaped model (GQA, top-2 MoE in every layer) is built by transformers, imported into
our checkpoint format and exported again; transformers loads the export (fp32, its default
attention), ours the checkpoint. Both generate `--new-tokens` tokens greedily (no stop token) for
`--batch` prompts of `--prompt-len` random tokens, and one token alone for the time to first token;
the four runs alternate within each repeat, the first repeat is a warm-up, the median of the rest
is reported. Both produce the same tokens (checked). tokens/s = batch x new tokens / seconds of the
whole call; decode tokens/s = batch x (new - 1) / (seconds - time to first token). Prints one JSON
object (with the machine, the command and torch / transformers versions).
"""
import argparse
import json
import statistics
import sys
import tempfile

import torch

from megatron_moe.convert import offline
from megatron_moe.generation import generate
from megatron_moe.inference import DROPLESS, load_model
from megatron_moe.perf import timing
from megatron_moe.perf.machine import machine_info


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    p.add_argument("--device", default="cpu")
    return p.parse_args(argv)


def build(args, tmp: str):
    import transformers

    config = transformers.MixtralConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                                        num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                        num_key_value_heads=args.kv_heads, num_local_experts=args.experts,
                                        num_experts_per_tok=2, max_position_embeddings=args.prompt_len + args.new_tokens)
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).save_pretrained(f"{tmp}/hf")
    ours = offline.import_hf(f"{tmp}/hf", f"{tmp}/ours")
    offline.export_hf(ours, f"{tmp}/export")
    theirs = transformers.MixtralForCausalLM.from_pretrained(f"{tmp}/export", dtype=torch.float32).to(args.device).eval()
    return load_model(ours, device=args.device, overrides=DROPLESS), theirs


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = torch.randint(0, args.vocab, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(1))
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        ours, theirs = build(args, tmp)
        inputs = prompts.to(device)
        mask = torch.ones_like(inputs)

        def hf(new):
            with torch.no_grad():
                return theirs.generate(inputs, attention_mask=mask, do_sample=False, max_new_tokens=new,
                                       min_new_tokens=new, eos_token_id=None, pad_token_id=0)[:, args.prompt_len:]

        runs = {"ours": lambda new: generate(ours, prompts.tolist(), new), "transformers": hf}
        times = {(name, new): [] for name in runs for new in (1, args.new_tokens)}
        outputs = {}
        for repeat in range(args.repeats + 1):
            for (name, new), seconds in times.items():
                with timing.wall(device) as w:
                    outputs[name, new] = runs[name](new)
                if repeat:  # the first repeat warms up
                    seconds.append(w.seconds)
    same = [o.tokens for o in outputs["ours", args.new_tokens]] == outputs["transformers", args.new_tokens].tolist()
    result = {"command": "python " + " ".join(sys.argv), "machine": machine_info(),
              "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
              "shape": vars(args), "same_tokens": same}
    for name in runs:
        total, first = (statistics.median(times[name, n]) for n in (args.new_tokens, 1))
        result[name] = {"seconds": total, "time_to_first_token_s": first,
                        "tokens_per_s": args.batch * args.new_tokens / total,
                        "decode_tokens_per_s": args.batch * (args.new_tokens - 1) / max(total - first, 1e-9),
                        "all_seconds": times[name, args.new_tokens]}
    result["ours_vs_transformers_tokens_per_s"] = result["ours"]["tokens_per_s"] / result["transformers"]["tokens_per_s"]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
