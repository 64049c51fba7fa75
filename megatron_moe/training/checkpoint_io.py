"""Checkpoint storage format: torch.distributed.checkpoint (DCP) with global tensor identities,
a manifest for integrity, and loading that never unpickles arbitrary objects.

Sharded tensors. Every entry of a checkpoint is a *global* tensor; a rank contributes the chunks
it holds, each with its offsets into the global tensor (from `ParamMeta`: global shape + the
offsets of this rank's shard along every dim). Instead of wrapping shards in ShardedTensor
(whose metadata exchange wants a process group per tensor) or DTensor (which needs a
DeviceMesh per sharding pattern), two small DCP planners turn `ShardedEntry` chunks straight
into DCP's `ChunkStorageMetadata(offsets, sizes)` write/read items. DCP then does the rest:

* save: identical chunks offered by several ranks (replicas over dp / edp / tp) have the same
  `MetadataIndex(fqn, offsets)` and are written once (DCP's plan de-duplication);
* load: each rank asks for the chunks *it* needs under the current layout; DCP reads the
  overlapping pieces of whatever chunks were saved, so any layout loads any other.

One process may offer several chunks of one tensor (offline resharding writes a whole target
layout from one process).

Integrity: `checkpoint_files.py` (the manifest; that module is what training imports at
start-up, this one, with DCP, only when it saves or loads).

Safety. DCP's `.metadata` file is a pickle of its own metadata dataclasses: it is read with an
allow-list unpickler (DCP metadata classes, torch.Size/dtype, builtin containers) and anything
else is refused. Tensor data is read by DCP with `torch.load(weights_only=True)`. Non-tensor
(pickled "bytes") entries are refused; all plain metadata lives in JSON/YAML files.
"""
from __future__ import annotations

import contextlib
import io
import os
import pickle
import warnings
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_moe.distributed import collectives
from megatron_moe.training.checkpoint_files import DCP_METADATA, ShardedEntry, full_entry, interleaved_swiglu_dim
from megatron_moe.training.failures import CheckpointError


def _chunk_md(tensor: torch.Tensor, offsets: Sequence[int]) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.size())


class _ShardedSavePlanner(DefaultSavePlanner):
    """Write items from `ShardedEntry` chunks (global shape + offsets), de-duplicated by DCP."""

    def __init__(self, entries: Dict[str, ShardedEntry]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.entries = entries

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, entry in self.entries.items():
            for tensor, offsets in entry.chunks:
                items.append(WriteItem(
                    index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=_chunk_md(tensor, offsets),
                                                properties=TensorProperties.create_from_tensor(tensor),
                                                size=torch.Size(entry.global_shape))))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> torch.Tensor:
        for tensor, offsets in self.entries[index.fqn].chunks:
            if torch.Size(offsets) == index.offset:
                return tensor.detach()
        raise KeyError(index)


class _ShardedLoadPlanner(DefaultLoadPlanner):
    """Read items that fill each `ShardedEntry` chunk from the overlapping saved chunks."""

    def __init__(self, entries: Dict[str, ShardedEntry], path: str):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.entries, self.path = entries, path
        self._chunk_of: Dict[Tuple[str, torch.Size], torch.Tensor] = {}

    def create_local_plan(self) -> LoadPlan:
        requests = []
        for fqn, entry in self.entries.items():
            md = self.metadata.state_dict_metadata[fqn]
            for tensor, offsets in entry.chunks:
                self._chunk_of[(fqn, torch.Size(offsets))] = tensor
                requests += create_read_items_for_chunk_list(fqn, md, [_chunk_md(tensor, offsets)])
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self._chunk_of[(index.fqn, index.offset)]

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        raise CheckpointError(f"checkpoint {self.path}: {read_item.dest_index.fqn!r} is a pickled payload; refused")


# -- safe metadata ------------------------------------------------------------------------------
_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch", "float32"), ("torch", "float64"), ("torch", "float16"), ("torch", "bfloat16"),
    ("torch", "int64"), ("torch", "int32"), ("torch", "uint8"), ("torch", "bool"), ("torch", "int8"),
    ("torch", "strided"), ("torch", "contiguous_format"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")


class SafeFileSystemReader(FileSystemReader):
    """DCP reader whose `.metadata` unpickling only admits DCP's metadata classes."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = os.path.join(str(self.path), DCP_METADATA)
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, AttributeError, EOFError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"checkpoint {self.path}: {DCP_METADATA} refused ({exc})") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"checkpoint {self.path}: {DCP_METADATA} does not hold DCP metadata")
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                raise CheckpointError(f"checkpoint {self.path}: {fqn!r} is a pickled payload; refused")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_metadata(path: str) -> Metadata:
    return SafeFileSystemReader(path).read_metadata()


# -- save / load --------------------------------------------------------------------------------
def _no_dist() -> bool:
    return not collectives.is_initialized()


def save_entries(entries: Dict[str, ShardedEntry], path: str, single_process: bool = False) -> None:
    """Collective (every rank of the default group) unless `single_process`: write `entries` as a
    DCP checkpoint at `path`."""
    with _quiet():
        dcp.save({}, storage_writer=FileSystemWriter(path, sync_files=True), planner=_ShardedSavePlanner(entries),
                 no_dist=single_process or _no_dist())


def check_entries(metadata: Metadata, entries: Dict[str, ShardedEntry], path: str) -> None:
    """Every entry exists in the checkpoint as a tensor of the same global shape."""
    for fqn, entry in entries.items():
        md = metadata.state_dict_metadata.get(fqn)
        if md is None:
            raise CheckpointError(f"checkpoint {path} has no tensor {fqn!r}")
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"checkpoint {path}: {fqn!r} is a pickled payload; refused")
        if tuple(md.size) != tuple(entry.global_shape):
            if interleaved_swiglu_dim(tuple(md.size), tuple(entry.global_shape)) is not None:
                raise CheckpointError(
                    f"checkpoint {path} stores SwiGLU weights ({fqn} {tuple(md.size)}) in the old interleaved layout; "
                    f"convert it: python tools/convert_checkpoint.py upgrade-swiglu --input {path} --output NEW_DIR")
            raise CheckpointError(
                f"checkpoint {path}: {fqn} has global shape {tuple(md.size)} but this model expects "
                f"{tuple(entry.global_shape)} (the model config differs from the checkpoint's config.yaml)")


def load_entries(entries: Dict[str, ShardedEntry], path: str, single_process: bool = False) -> None:
    """Collective unless `single_process`: fill every chunk of `entries` in place from the DCP
    checkpoint at `path` (checked first, so problems surface as one-line CheckpointErrors)."""
    check_entries(read_metadata(path), entries, path)
    with _quiet():
        dcp.load({}, storage_reader=SafeFileSystemReader(path), planner=_ShardedLoadPlanner(entries, path),
                 no_dist=single_process or _no_dist())


@contextlib.contextmanager
def _quiet():
    """Silence DCP's 'assuming the intent is to save/load in a single process' warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def load_full(path: str, keys: Optional[Sequence[str]] = None) -> Dict[str, torch.Tensor]:
    """Single process: the full global tensors `keys` (default: all) of a checkpoint."""
    metadata = read_metadata(path)
    keys = list(metadata.state_dict_metadata) if keys is None else list(keys)
    out, entries = {}, {}
    for key in keys:
        md = metadata.state_dict_metadata[key]
        out[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        entries[key] = full_entry(out[key])
    load_entries(entries, path, single_process=True)
    return out
