"""Megatron-LM .bin/.idx format: round trips for every dtype code, the writer's bytes checked field
by field with struct (independently of our reader), merging, and corrupt inputs."""
import os
import struct

import numpy as np
import pytest

from megatron_moe.data.indexed import (DTYPE_CODES, IndexedDataset, IndexedDatasetBuilder, dtype_for_vocab,
                                       merge_datasets)

# documents as lists of sequences; the third document is empty (no sequences)
DOCS = [[[1, 2, 3], [4]], [[5, 6]], [], [[7], [8, 9, 10, 11]]]


def write(prefix, docs, dtype, modes=False):
    b = IndexedDatasetBuilder(str(prefix), dtype, multimodal=modes)
    for doc in docs:
        flat = [t for seq in doc for t in seq]
        b.add_document(flat, [len(s) for s in doc], [len(s) % 3 for s in doc] if modes else None)
    b.finalize()
    return str(prefix)


@pytest.mark.parametrize("code", sorted(DTYPE_CODES))
@pytest.mark.parametrize("modes", [False, True])
def test_round_trip_every_dtype(tmp_path, code, modes):
    dtype = DTYPE_CODES[code]
    rng = np.random.default_rng(code)
    hi = 100 if np.dtype(dtype).kind == "f" else np.iinfo(dtype).max
    docs = [[list(rng.integers(0, hi, size=n).astype(dtype)) for n in lens] for lens in ([3, 1], [5], [], [2, 7])]
    ds = IndexedDataset(write(tmp_path / "d", docs, dtype, modes))
    seqs = [s for d in docs for s in d]
    assert ds.dtype == np.dtype(dtype) and len(ds) == len(seqs) and ds.num_documents == 4
    assert ds.document_indices.tolist() == [0, 2, 3, 3, 5]
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(ds[i], np.asarray(s, dtype))
    np.testing.assert_array_equal(ds.get(4, offset=2, length=3), np.asarray(seqs[4][2:5], dtype))
    if modes:
        assert ds.sequence_modes.tolist() == [len(s) % 3 for s in seqs]
    else:
        assert ds.sequence_modes is None


def test_writer_bytes_field_by_field(tmp_path):
    prefix = write(tmp_path / "d", DOCS, np.uint16)
    idx = open(prefix + ".idx", "rb").read()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack_from("<Q", idx, 9) == (1,)  # version
    assert struct.unpack_from("<B", idx, 17) == (8,)  # uint16
    n, d = struct.unpack_from("<QQ", idx, 18)
    assert (n, d) == (5, 5)  # 5 sequences; 4 documents + 1
    off = 34
    assert struct.unpack_from("<5i", idx, off) == (3, 1, 2, 1, 4)  # lengths
    assert struct.unpack_from("<5q", idx, off + 20) == (0, 6, 8, 12, 14)  # byte offsets (2 bytes/token)
    assert struct.unpack_from("<5q", idx, off + 60) == (0, 2, 3, 3, 5)  # document indices
    assert len(idx) == off + 100
    assert open(prefix + ".bin", "rb").read() == struct.pack("<11H", *range(1, 12))


def test_merge_equals_single_write(tmp_path):
    whole = write(tmp_path / "whole", DOCS, np.int32, modes=True)
    a = write(tmp_path / "a", DOCS[:2], np.int32, modes=True)
    b = write(tmp_path / "b", DOCS[2:], np.int32, modes=True)
    merge_datasets([a, b], str(tmp_path / "merged"))
    for ext in (".bin", ".idx"):
        assert open(whole + ext, "rb").read() == open(str(tmp_path / "merged") + ext, "rb").read()
    other = write(tmp_path / "u16", DOCS, np.uint16)
    with pytest.raises(ValueError, match="dtype uint16 differs"):
        merge_datasets([a, other], str(tmp_path / "bad"))


@pytest.mark.parametrize("modes", [False, True])
def test_merge_with_parts_without_sequences(tmp_path, modes):
    """tools/preprocess_data.py --workers N on fewer than N lines merges empty parts (no sequence, no
    way to tell modes); they used to be read as having modes and refused ("present in only one")."""
    shards = [[], DOCS[:2], [[]], DOCS[2:], []]  # no document; two; one empty document; two; none
    whole = write(tmp_path / "whole", [doc for shard in shards for doc in shard], np.int32, modes)
    parts = [write(tmp_path / f"p{i}", shard, np.int32, modes) for i, shard in enumerate(shards)]
    merge_datasets(parts, str(tmp_path / "merged"))
    for ext in (".bin", ".idx"):
        assert open(whole + ext, "rb").read() == open(str(tmp_path / "merged") + ext, "rb").read()
    assert IndexedDataset(parts[0]).sequence_modes is None and len(IndexedDataset(parts[0])) == 0


def test_dtype_for_vocab():
    assert dtype_for_vocab(50257) == np.uint16 and dtype_for_vocab(65500) == np.int32


def _corrupt(prefix, kind):
    if kind == "truncated .bin":
        with open(prefix + ".bin", "r+b") as f:
            f.truncate(os.path.getsize(prefix + ".bin") - 2)
        return prefix + ".bin", "truncated"
    if kind == "long .bin":
        with open(prefix + ".bin", "ab") as f:
            f.write(b"\x00\x00")
        return prefix + ".bin", "too long"
    if kind == "missing .idx":
        os.remove(prefix + ".idx")
        return prefix + ".idx", "not found"
    if kind == "missing .bin":
        os.remove(prefix + ".bin")
        return prefix + ".bin", "not found"
    data = bytearray(open(prefix + ".idx", "rb").read())
    if kind == "wrong magic":
        data[:9] = b"TNTIDX\x00\x00\x00"  # the old, non-memory-mapped Megatron format
        problem = "magic"
    elif kind == "wrong version":
        data[9:17] = struct.pack("<Q", 2)
        problem = "version 2"
    elif kind == "bad dtype code":
        data[17] = 9
        problem = "dtype code 9"
    elif kind == "truncated .idx":
        data = data[:-8]
        problem = "truncated or corrupt"
    elif kind == "empty .idx":
        data = b""
        problem = "truncated index"
    open(prefix + ".idx", "wb").write(bytes(data))
    return prefix + ".idx", problem


@pytest.mark.parametrize("kind", ["truncated .bin", "long .bin", "missing .idx", "missing .bin", "wrong magic",
                                  "wrong version", "bad dtype code", "truncated .idx", "empty .idx"])
def test_corrupt_inputs_one_clear_line(tmp_path, kind):
    prefix = write(tmp_path / "d", DOCS, np.uint16)
    path, problem = _corrupt(prefix, kind)
    with pytest.raises(ValueError) as e:
        IndexedDataset(prefix)
    msg = str(e.value)
    assert msg.startswith(path + ":") and problem in msg and "\n" not in msg, msg
