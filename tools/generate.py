#!/usr/bin/env python
"""Sample from a checkpoint with its own tokenizer (docs/evaluation.md, megatron_moe/generation.py).

    python tools/generate.py --checkpoint runs/demo/checkpoints --prompt "def main(" [--prompt "..."]
        [--prompt-file F] [--max-new-tokens N] [--temperature T --top-p P --top-k K --seed S]
        [--batch-size B] [--ignore-eod] [--json]
    torchrun --nproc_per_node 2 tools/generate.py --checkpoint CKPT --tensor 2 --prompt "..."   (tp / ep)

Prompts: every --prompt, then --prompt-file's (one per line; a .jsonl file: one JSON string or
{"prompt": ...} per line, so prompts may hold newlines), generated B at a time as one left-padded
batch. Greedy unless --temperature > 0. A sequence stops at the tokenizer's end-of-document token
(unless --ignore-eod) or after --max-new-tokens. MoE layers run dropless (moe.capacity_factor=null
overrides a capacity-mode checkpoint's setting). Prints each prompt with its completion and its
tokens/s (the decode rate after the first new token) and time to first token; --json prints one
JSON object per prompt instead: prompt, prompt_tokens, new_tokens, text, tokens_per_s,
time_to_first_token_s. Bad input: one line on stderr, exit 2.
"""
import argparse
import json
import os
import sys

from megatron_moe.config import ConfigError
from megatron_moe.training.failures import CheckpointError


def read_prompts(args) -> list:
    prompts = list(args.prompt or [])
    if args.prompt_file:
        if not os.path.isfile(args.prompt_file):
            raise ValueError(f"--prompt-file {args.prompt_file}: not found")
        with open(args.prompt_file, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
        if args.prompt_file.endswith(".jsonl"):
            try:
                rows = [json.loads(line) for line in lines]
            except json.JSONDecodeError as exc:
                raise ValueError(f"--prompt-file {args.prompt_file}: not JSON lines ({exc})") from None
            lines = [row["prompt"] if isinstance(row, dict) and "prompt" in row else row for row in rows]
            if not all(isinstance(p, str) for p in lines):
                raise ValueError(f"--prompt-file {args.prompt_file}: each line must be a JSON string or {{\"prompt\": ...}}")
        prompts += lines
    if not prompts:
        raise ValueError("give at least one --prompt or a --prompt-file")
    return prompts


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="a checkpoint root (its newest complete one) or an iter_* directory")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--prompt-file", help="prompts, one per line (.jsonl: JSON strings or {\"prompt\": ...})")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set reaching p")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8, help="prompts per batch")
    p.add_argument("--ignore-eod", action="store_true", help="do not stop at the end-of-document token")
    p.add_argument("--tensor", type=int, default=1, help="tensor-parallel degree (under torchrun)")
    p.add_argument("--expert", type=int, default=1, help="expert-parallel degree (under torchrun)")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    args = p.parse_args(argv)
    if args.batch_size < 1:
        p.error(f"--batch-size {args.batch_size} must be >= 1")
    return args


def report(prompt: str, result, text: str, as_json: bool) -> str:
    if as_json:
        return json.dumps({"prompt": prompt, "prompt_tokens": result.prompt_tokens, "new_tokens": len(result.tokens),
                           "text": text, "tokens_per_s": result.tokens_per_s,
                           "time_to_first_token_s": result.time_to_first_token_s})
    rate = "-" if result.tokens_per_s is None else f"{result.tokens_per_s:.1f}"
    return (f"{prompt}{text}\n[{result.prompt_tokens} prompt tokens, {len(result.tokens)} new, {rate} tokens/s, "
            f"first token after {result.time_to_first_token_s:.3f} s]")


def run(args) -> None:
    from megatron_moe.training.checkpoint_tokenizer import load_checkpoint_tokenizer
    from megatron_moe.distributed import collectives
    from megatron_moe.generation import generate
    from megatron_moe.inference import DROPLESS, launch_layout, load_model
    from megatron_moe.training.checkpoint import checkpoint_config, resolve_checkpoint

    prompts = read_prompts(args)
    tokenizer = load_checkpoint_tokenizer(args.checkpoint)
    state = None
    try:
        info, state = launch_layout(args.tensor, args.expert)
        model = load_model(args.checkpoint, device=info.device or "cpu", overrides=DROPLESS, state=state)
        # load_model verified the files: the config by names only (no second SHA-256 pass over the checkpoint)
        trained = checkpoint_config(resolve_checkpoint(args.checkpoint, verify=False)).moe.capacity_factor
        if trained is not None and info.rank == 0:
            print(f"note: trained with moe.capacity_factor={trained}; generating dropless (moe.capacity_factor=null)",
                  file=sys.stderr)
        stops = [] if args.ignore_eod else [tokenizer.eod]
        for start in range(0, len(prompts), args.batch_size):
            batch = prompts[start:start + args.batch_size]
            results = generate(model, [tokenizer.tokenize(p) for p in batch], args.max_new_tokens,
                               temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                               stop_tokens=stops, pad_id=tokenizer.eod)
            for prompt, result in zip(batch, results):
                new = result.tokens[:-1] if result.stopped else result.tokens  # the stop token is not text
                if info.rank == 0:
                    print(report(prompt, result, tokenizer.detokenize(new), args.json), flush=True)
    finally:
        collectives.destroy_process_group(state)


def main(argv=None) -> int:
    args = parse(argv)
    try:
        run(args)
    except (CheckpointError, ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
