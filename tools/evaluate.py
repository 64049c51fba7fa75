#!/usr/bin/env python
"""lm-evaluation-harness on a checkpoint: lm-eval's own command line with the `megatron_moe` backend
registered (megatron_moe/evaluation/lm_eval_model.py; docs/evaluation.md).

    python tools/evaluate.py --model_args checkpoint=runs/demo/checkpoints \\
        --tasks stdlib_mc,stdlib_gen --include_path configs/eval_tasks --batch_size 8 \\
        [--limit N] [--output_path results/] [--log_samples]
    torchrun --nproc_per_node 2 tools/evaluate.py --model_args checkpoint=DIR,tensor=2 --tasks ...   (tp / ep)

Every flag is lm-eval's (`lm-eval run --help`); `--model megatron_moe` is the default (`--model hf
--model_args pretrained=EXPORT` scores an export with lm-eval's own backend). `--model_args` of
megatron_moe: checkpoint=DIR (required), tensor=, expert= (under torchrun), max_length=,
max_gen_toks=, seed=. Runs offline (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE default to 1: the local
tasks need no downloads; set them to 0 for lm-eval's hub tasks). Bad input: one line on stderr, exit 2.
"""
import os
import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for key in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(key, "1")
    if not any(a == "--model" or a.startswith("--model=") for a in argv) and not {"-h", "--help"} & set(argv):
        argv = ["--model", "megatron_moe"] + argv
    try:
        from lm_eval.__main__ import cli_evaluate

        from megatron_moe.evaluation import lm_eval_model  # registers `megatron_moe` with lm-eval
    except ImportError as exc:
        print(f"error: tools/evaluate.py needs lm-evaluation-harness ({exc}): pip install -e '.[eval]'", file=sys.stderr)
        return 2
    from megatron_moe.config import ConfigError
    from megatron_moe.training.failures import CheckpointError

    saved, sys.argv = sys.argv, ["lm-eval"] + (argv if argv[:1] == ["run"] or {"-h", "--help"} & set(argv)
                                               else ["run"] + argv)
    try:
        cli_evaluate()
    except (CheckpointError, ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        sys.argv = saved
        for lm in lm_eval_model.LOADED:
            lm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
