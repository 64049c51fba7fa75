"""The plain files of a checkpoint directory and the type of its entries, without importing
torch.distributed.checkpoint (~1 s per process): training imports this at start-up, the DCP
reading and writing (`checkpoint_io.py`) only when it saves or loads.

Integrity. `manifest.json` (written last, before the directory is renamed into place) lists
every file with its size and SHA-256; `verify_manifest` refuses a checkpoint with a missing,
truncated, modified or unexpected file, naming it.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch

from megatron_moe.training.failures import CheckpointError

MANIFEST = "manifest.json"
DCP_METADATA = ".metadata"


@dataclass
class ShardedEntry:
    """One global tensor: its shape and the chunks (local tensor, offsets) this process holds."""

    global_shape: Tuple[int, ...]
    chunks: List[Tuple[torch.Tensor, Tuple[int, ...]]] = field(default_factory=list)


def full_entry(tensor: torch.Tensor) -> ShardedEntry:
    """A tensor held in full (replicated, or a single-process model)."""
    return ShardedEntry(tuple(tensor.shape), [(tensor, (0,) * tensor.dim())])


def interleaved_swiglu_dim(stored: Sequence[int], expected: Sequence[int]) -> Optional[int]:
    """The dim k at which `expected` holds SwiGLU's (2, f) = (gate, up) units while `stored` has
    them merged into one dim of 2f (the interleaved layout before issue #16), or None."""
    stored, expected = tuple(stored), tuple(expected)
    for k in range(len(expected) - 1):
        if expected[k] == 2 and stored == expected[:k] + (2 * expected[k + 1],) + expected[k + 2:]:
            return k
    return None


# -- manifest -----------------------------------------------------------------------------------
def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(path: str) -> List[str]:
    """Every file under `path`, as '/'-separated relative paths (subdirectories: the tokenizer's)."""
    out = []
    for directory, subdirs, names in os.walk(path):
        subdirs.sort()
        rel = os.path.relpath(directory, path)
        out += [name if rel == "." else f"{rel.replace(os.sep, '/')}/{name}" for name in sorted(names)]
    return out


def write_manifest(path: str) -> None:
    """List every file of the checkpoint directory (and its subdirectories) with size and SHA-256; written last."""
    files = {name: {"size": os.path.getsize(os.path.join(path, name)), "sha256": _sha256(os.path.join(path, name))}
             for name in _files(path) if name != MANIFEST}
    write_json(os.path.join(path, MANIFEST), {"format": "megatron_moe-dcp-v1", "files": files})


def verify_manifest(path: str, only: str = "") -> None:
    """Raise CheckpointError naming the first missing, truncated, modified or unexpected file
    (`only`: of the files whose path starts with it, e.g. "tokenizer/")."""
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not os.path.isfile(manifest_path):
        raise CheckpointError(f"checkpoint {path} is incomplete: no {MANIFEST} (the save did not finish)")
    try:
        files = read_json(manifest_path)["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is corrupt ({exc})") from None
    for name, expect in files.items():
        if not name.startswith(only):
            continue
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"checkpoint {path}: file {name} is missing")
        size = os.path.getsize(file)
        if size != expect["size"]:
            raise CheckpointError(f"checkpoint {path}: file {name} has {size} bytes, the manifest says {expect['size']}")
        if _sha256(file) != expect["sha256"]:
            raise CheckpointError(f"checkpoint {path}: file {name} is corrupt (SHA-256 differs from the manifest)")
    extra = sorted(n for n in set(_files(path)) - set(files) - {MANIFEST} if n.startswith(only))
    if extra:
        raise CheckpointError(f"checkpoint {path}: unexpected file {extra[0]} (not in the manifest)")


def write_json(path: str, data) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def read_json(path: str):
    with open(path) as f:
        return json.load(f)
