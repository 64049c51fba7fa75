"""The tokenizer a checkpoint carries (docs/checkpoints.md, "The tokenizer"): for generation and
evaluation (tools/generate.py, the lm-eval backend) and export-hf (convert/hf_tokenizer.py).

    from megatron_moe.training.checkpoint_tokenizer import load_checkpoint_tokenizer
    tok = load_checkpoint_tokenizer("checkpoints/run1")   # a checkpoint root or one iter_* directory
    ids = tok.encode("text")                              # = tok.tokenize: the ids training gave it
    text = tok.decode(ids); tok.eod; tok.pad; tok.vocab_size

Saving is `write_checkpoint_dir`'s (training/checkpoint.py: `tokenizer/` = copies of the files +
`tokenizer_spec.json`, data/tokenizers.py).
"""
from __future__ import annotations

import os

from megatron_moe.data.tokenizers import (CHECKPOINT_TOKENIZER, SPEC_FILE, Tokenizer, TokenizerSpec,
                                          read_checkpoint_tokenizer)
from megatron_moe.training.checkpoint import checkpoint_config, checkpoint_dirs, is_checkpoint_root
from megatron_moe.training.checkpoint_files import verify_manifest


def checkpoint_tokenizer_spec(path: str) -> TokenizerSpec:
    """The tokenizer of checkpoint `path` (a root: its newest checkpoint): the copy it carries, its
    files checked against the manifest (CheckpointError naming a damaged one); for a checkpoint
    saved before checkpoints carried one, the files its config names if they still exist;
    ValueError, one line, otherwise."""
    if is_checkpoint_root(path):
        path = checkpoint_dirs(path)[-1]
    directory = os.path.join(path, CHECKPOINT_TOKENIZER)
    if os.path.isfile(os.path.join(directory, SPEC_FILE)):
        verify_manifest(path, only=CHECKPOINT_TOKENIZER + "/")
        return read_checkpoint_tokenizer(directory)
    t = checkpoint_config(path).data.tokenizer
    files = [p for p in (t.vocab_file, t.merge_file, t.model) if p]
    if t.type is None or not all(os.path.exists(p) for p in files):
        gone = " and the data.tokenizer files its config names are gone" if t.type else ""
        raise ValueError(f"{path} carries no tokenizer (saved before checkpoints recorded theirs, or trained "
                         f"without a data pipeline){gone}")
    return TokenizerSpec(t.type, t.vocab_file, t.merge_file, t.model)


def load_checkpoint_tokenizer(path: str) -> Tokenizer:
    """The tokenizer checkpoint `path` (a root or one iter_* directory) was trained with: the data
    pipeline's object (data/tokenizers.py: `encode`/`tokenize`, `decode`/`detokenize`, `eod`, `pad`,
    `vocab_size`, `special_ids`)."""
    return checkpoint_tokenizer_spec(path).build()
