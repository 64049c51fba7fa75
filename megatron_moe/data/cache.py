"""Build-once caches shared by concurrent processes (every rank may ask at the same time).

The first process to take the directory's `.megatron_moe.lock` builds; the others wait for the
lock, then find the marker, which the builder writes last (after atomic renames), and reuse the result. No process
group is needed, so this works before or without torch.distributed.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Callable, Dict

import numpy as np
from filelock import FileLock


def default_cache_dir() -> str:
    """$MEGATRON_MOE_CACHE, else $XDG_CACHE_HOME/megatron_moe, else ~/.cache/megatron_moe."""
    if os.environ.get("MEGATRON_MOE_CACHE"):
        return os.environ["MEGATRON_MOE_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "megatron_moe")


def description_hash(description: dict) -> str:
    return hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()


def build_once(marker: str, build: Callable[[], None]) -> None:
    """Run `build` unless `marker` exists; `build` must create `marker` last."""
    if os.path.exists(marker):
        return
    directory = os.path.dirname(os.path.abspath(marker))
    os.makedirs(directory, exist_ok=True)
    with FileLock(os.path.join(directory, ".megatron_moe.lock")):
        if not os.path.exists(marker):
            build()
            assert os.path.exists(marker), f"{marker}: the build did not write its marker"


def save_atomic(path: str, array: np.ndarray) -> None:
    tmp = f"{path}.tmp{os.getpid()}.npy"
    np.save(tmp, array)
    os.replace(tmp, path)


def cached_arrays(directory: str, stem: str, description: dict,
                  build: Callable[[], Dict[str, np.ndarray]]) -> Dict[str, np.ndarray]:
    """Arrays from `build()`, saved once as `<directory>/<stem>.<hash>.<name>.npy` (hash of
    `description`, which is written beside them as JSON) and memory-mapped on every later call."""
    base = os.path.join(directory, f"{stem}.{description_hash(description)}")

    def _build() -> None:
        arrays = build()
        for name, array in arrays.items():
            save_atomic(f"{base}.{name}.npy", array)
        with open(base + ".json.tmp", "w") as f:
            json.dump(dict(description, arrays=sorted(arrays)), f, indent=1, sort_keys=True)
        os.replace(base + ".json.tmp", base + ".json")

    build_once(base + ".json", _build)
    with open(base + ".json") as f:
        names = json.load(f)["arrays"]
    return {name: np.load(f"{base}.{name}.npy", mmap_mode="r") for name in names}
