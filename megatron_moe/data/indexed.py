"""Megatron-LM's memory-mapped indexed dataset (`<prefix>.bin` + `<prefix>.idx`), byte-compatible.

`.idx` layout (little-endian), as written by Megatron-LM's `IndexedDatasetBuilder`:

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    u64       version = 1
    u8        dtype code (DTYPE_CODES)
    u64       sequence count  N
    u64       document count  D   (= documents + 1)
    int32[N]  sequence lengths (tokens)
    int64[N]  sequence pointers (byte offset of each sequence in `.bin`)
    int64[D]  document indices: 0, then the sequence count after each document
    int8[N]   sequence modes (optional; present iff the file is that much longer)

`.bin` holds the sequences' token ids back to back. A document is one or more sequences (one per
sentence with `--split-sentences`, else one); documents with no tokens have no sequences.
"""
from __future__ import annotations

import os
import shutil
import struct
from array import array
from typing import Iterable, Optional, Sequence

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32,
    5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def dtype_for_vocab(vocab_size: int) -> type:
    """Token dtype for a vocabulary: uint16 when it fits, else int32 (Megatron's 65500 threshold)."""
    return np.uint16 if vocab_size < 65500 else np.int32


def exists(prefix: str) -> bool:
    return os.path.isfile(bin_path(prefix)) and os.path.isfile(idx_path(prefix))


class IndexedDataset:
    """Memory-mapped reader. `ds[i]` is sequence i as a numpy array (a read-only view of `.bin`).

    Every check here is O(1) in the dataset size, so opening a multi-terabyte corpus stays instant.
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx, bin_ = idx_path(prefix), bin_path(prefix)
        for path, other in ((idx, bin_), (bin_, idx)):
            if not os.path.isfile(path):
                have = "exists" if os.path.isfile(other) else "is missing too"
                raise ValueError(f"{path}: file not found ({os.path.basename(other)} {have}; "
                                 "an indexed dataset needs both .bin and .idx)")
        self._idx_buf = np.memmap(idx, dtype=np.uint8, mode="r") if os.path.getsize(idx) else b""
        if len(self._idx_buf) < _HEADER.size:
            raise ValueError(f"{idx}: truncated index ({len(self._idx_buf)} bytes, header needs {_HEADER.size})")
        magic, version, code, n, d = _HEADER.unpack_from(bytes(self._idx_buf[:_HEADER.size]))
        if magic != MAGIC:
            raise ValueError(f"{idx}: not a Megatron indexed-dataset index (magic {magic!r}, expected {MAGIC!r})")
        if version != VERSION:
            raise ValueError(f"{idx}: unsupported index version {version} (expected {VERSION})")
        if code not in DTYPE_CODES:
            raise ValueError(f"{idx}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
        self.dtype = np.dtype(DTYPE_CODES[code])
        base = _HEADER.size + 12 * n + 8 * d
        if len(self._idx_buf) not in (base, base + n):
            raise ValueError(f"{idx}: {len(self._idx_buf)} bytes, but its header ({n} sequences, {d} document "
                             f"indices) needs {base} (or {base + n} with modes); truncated or corrupt")
        off = _HEADER.size
        self.sequence_lengths = np.frombuffer(self._idx_buf, np.int32, n, off)
        self.sequence_pointers = np.frombuffer(self._idx_buf, np.int64, n, off + 4 * n)
        self.document_indices = np.frombuffer(self._idx_buf, np.int64, d, off + 12 * n)
        self.sequence_modes = (np.frombuffer(self._idx_buf, np.int8, n, base)  # none to tell without sequences
                               if n and len(self._idx_buf) == base + n else None)
        if d < 1 or self.document_indices[0] != 0 or self.document_indices[-1] != n:
            raise ValueError(f"{idx}: document indices must start at 0 and end at the sequence count {n}")
        bin_size = os.path.getsize(bin_)
        want = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize if n else 0
        if bin_size != want:
            raise ValueError(f"{bin_}: {bin_size} bytes, but {idx} describes {want} bytes of "
                             f"{self.dtype.name} tokens ({'truncated' if bin_size < want else 'too long'})")
        self._bin_buf = np.memmap(bin_, dtype=np.uint8, mode="r") if bin_size else b""

    def __reduce__(self):  # reopen by path in DataLoader workers instead of pickling the maps
        return (IndexedDataset, (self.prefix,))

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence i."""
        if length is None:
            length = int(self.sequence_lengths[i]) - offset
        start = int(self.sequence_pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin_buf, self.dtype, length, start)

    def read_tokens(self, token_offset: int, count: int) -> np.ndarray:
        """`count` tokens of `.bin` starting at token `token_offset` (may span consecutive sequences)."""
        return np.frombuffer(self._bin_buf, self.dtype, count, token_offset * self.dtype.itemsize)


class IndexedDatasetBuilder:
    """Streaming writer: tokens go to `.bin` as they arrive; lengths and indices stay in compact
    arrays until `finalize()` writes `.idx`. API follows Megatron-LM's builder."""

    def __init__(self, prefix: str, dtype=np.int32, multimodal: bool = False):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ValueError(f"{prefix}: dtype {self.dtype} has no indexed-dataset code")
        self.multimodal = multimodal
        self._bin = open(bin_path(prefix), "wb")
        self._lengths = array("i")  # int32
        self._document_indices = array("q", [0])  # int64
        self._modes = array("b")  # int8

    def add_item(self, tokens: Sequence[int], mode: int = 0) -> None:
        """Append one sequence."""
        data = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(data.tobytes(order="C"))
        self._lengths.append(data.size)
        if self.multimodal:
            self._modes.append(mode)

    def end_document(self) -> None:
        self._document_indices.append(len(self._lengths))

    def add_document(self, tokens: Sequence[int], lengths: Iterable[int], modes: Optional[Iterable[int]] = None) -> None:
        """Append one document: `tokens` split into sequences of `lengths` (which may be empty)."""
        data = np.asarray(tokens, dtype=self.dtype)
        lengths = list(lengths)
        assert sum(lengths) == data.size, "document lengths must add up to its token count"
        self._bin.write(data.tobytes(order="C"))
        self._lengths.extend(lengths)
        if self.multimodal:
            self._modes.extend(modes if modes is not None else [0] * len(lengths))
        self.end_document()

    def add_index(self, prefix: str) -> None:
        """Append a whole finished dataset (merging partial outputs); dtypes must match."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"{idx_path(prefix)}: dtype {other.dtype.name} differs from {self.dtype.name} of {self.prefix}")
        if len(other) and self.multimodal != (other.sequence_modes is not None):
            raise ValueError(f"{idx_path(prefix)}: sequence modes present in only one of the merged datasets")
        base = len(self._lengths)
        self._lengths.frombytes(other.sequence_lengths.tobytes())
        self._document_indices.frombytes((other.document_indices[1:] + base).tobytes())
        if self.multimodal and len(other):
            self._modes.frombytes(other.sequence_modes.tobytes())
        with open(bin_path(prefix), "rb") as f:
            shutil.copyfileobj(f, self._bin, 16 << 20)

    def finalize(self) -> None:
        self._bin.close()
        lengths = np.frombuffer(self._lengths, np.int32) if self._lengths else np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        with open(idx_path(self.prefix), "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[self.dtype], len(lengths), len(self._document_indices)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(self._document_indices.tobytes())
            if self.multimodal:
                f.write(self._modes.tobytes())


def merge_datasets(prefixes: Sequence[str], output_prefix: str) -> None:
    """Concatenate finished datasets in order into `output_prefix` (Megatron's merge_datasets)."""
    parts = [IndexedDataset(p) for p in prefixes]
    # a part without sequences (a worker's shard of empty documents, or none) has no modes to tell
    builder = IndexedDatasetBuilder(output_prefix, parts[0].dtype,
                                    multimodal=any(d.sequence_modes is not None for d in parts))
    for p in prefixes:
        builder.add_index(p)
    builder.finalize()
