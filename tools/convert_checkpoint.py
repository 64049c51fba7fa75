#!/usr/bin/env python
"""Offline checkpoint conversions (docs/checkpoints.md). One process, no GPU needed.

    reshard    --input CKPT --output OUT --tensor T --expert E --expert-shard S [--force]
    reshard    --input CKPT --output FILE.safetensors --consolidated
    export-hf  --input CKPT --output HF_DIR [--family mixtral|qwen2_moe|qwen3_moe|olmoe|deepseek_v3|glm4_moe|gpt_oss]
               [--max-shard-mb N] [--precision fp32|bf16] [--force]   (default precision: the run's training.precision)
    import-hf  --input HF_DIR --output CKPT [--config BASE.yaml] [--num-experts N [--top-k K]] [--allow-unused]
               [--force] [section.key=value ...]
               (the family from config.json's model_type: any export-hf family or kimi_k2 (as deepseek_v3); a dense
               Llama / Mistral / Qwen3 directory: our dense model, or upcycled with --num-experts)
    upcycle    --input DENSE_CKPT --num-experts N [--top-k K] --output CKPT [--force]
    upgrade-swiglu --input OLD_CKPT --output CKPT [--force]   (SwiGLU checkpoints from before the halves layout)

CKPT may be a checkpoint root (its newest complete checkpoint is used) or one iter_* directory.
An output is written beside OUT and swapped in when complete; a non-empty OUT is refused unless
--force (export-hf replaces an earlier export of its own without it).
"""
import argparse
import sys

from megatron_moe.config import ConfigError
from megatron_moe.convert import offline
from megatron_moe.convert.hf_families import FAMILIES
from megatron_moe.training.failures import CheckpointError


def _paths(p) -> None:
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--force", action="store_true",
                   help="replace a non-empty --output (reshard --consolidated overwrites its file anyway)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("reshard", help="rewrite for another parallel layout, or consolidate into one file")
    _paths(p)
    p.add_argument("--tensor", type=int, default=1)
    p.add_argument("--expert", type=int, default=1)
    p.add_argument("--expert-shard", type=int, default=1)
    p.add_argument("--consolidated", action="store_true", help="write every global tensor into one safetensors file")
    p = sub.add_parser("export-hf", help="checkpoint -> Hugging Face MoE directory (--family)")
    _paths(p)
    p.add_argument("--family", help=f"config.json model_type: {' | '.join(FAMILIES)}; default: from the model's shape "
                                    "(docs/checkpoints.md)")
    p.add_argument("--max-shard-mb", type=int, default=5 * 1024, help="safetensors shard size limit (default 5 GiB)")
    p.add_argument("--precision", choices=["fp32", "bf16"],
                   help="dtype of the exported weights (default: the checkpoint's training.precision)")
    p = sub.add_parser("import-hf", help="Hugging Face MoE or dense directory (family from its config.json) -> checkpoint")
    _paths(p)
    p.add_argument("--allow-unused", action="store_true",
                   help="skip (and list) tensors the model does not use instead of refusing them")
    p.add_argument("--config", help="base YAML for the non-model settings (training, optimizer, ...)")
    p.add_argument("--num-experts", type=int, help="dense families: upcycle to N experts per layer, each = the dense FFN")
    p.add_argument("--top-k", type=int, help="with --num-experts: experts per token (default: the config's moe.top_k)")
    p.add_argument("overrides", nargs="*")
    p = sub.add_parser("upcycle", help="dense checkpoint -> MoE checkpoint, every expert = the dense FFN")
    _paths(p)
    p.add_argument("--num-experts", type=int, required=True)
    p.add_argument("--top-k", type=int, help="experts per token (default: the checkpoint's moe.top_k)")
    p = sub.add_parser("upgrade-swiglu", help="interleaved (gate, up) SwiGLU weights -> the halves layout")
    _paths(p)
    args = parser.parse_args(argv)
    try:
        if args.command == "reshard" and args.consolidated:
            offline.consolidate(args.input, args.output)
            out = args.output
        elif args.command == "reshard":
            out = offline.reshard(args.input, args.output, args.tensor, args.expert, args.expert_shard, args.force)
        elif args.command == "export-hf":
            offline.export_hf(args.input, args.output, args.family, args.max_shard_mb << 20, args.precision, args.force)
            out = args.output
        elif args.command == "import-hf":
            if args.top_k is not None and args.num_experts is None:
                parser.error("--top-k goes with --num-experts (upcycling a dense model)")
            out = offline.import_hf(args.input, args.output, args.config, args.overrides, args.num_experts, args.top_k,
                                    args.force, args.allow_unused)
        elif args.command == "upgrade-swiglu":
            out = offline.upgrade_swiglu(args.input, args.output, args.force)
        else:
            out = offline.upcycle(args.input, args.num_experts, args.output, args.top_k, args.force)
    except (CheckpointError, ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
