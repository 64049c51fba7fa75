"""Embedded default data (`data.path: null`): real text that exists on every machine.

The corpus is the Python standard library's own `.py` sources (no test suites, no site-packages),
read in sorted path order and cut into documents at two or more blank lines (PEP 8's separation
between top-level definitions), up to `max_bytes`. A byte-level BPE is trained on it and both are
preprocessed into indexed datasets (document level, and sentence level for BERT) in
`<cache_dir>/embedded/<hash>/`, keyed by a hash of the text and the parameters. Every call takes a
file lock (concurrent ranks don't race) and checks the files against the manifest's SHA-256 sums;
only a missing or damaged build is (re)built. Different Python versions have different standard
libraries and therefore build different (each deterministic) corpora.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sysconfig
from dataclasses import dataclass
from typing import List, Optional

from filelock import FileLock

from megatron_moe.data.cache import default_cache_dir
from megatron_moe.data.preprocess import EncodeOptions, preprocess
from megatron_moe.data.tokenizer_training import train_bpe
from megatron_moe.data.tokenizers import TokenizerSpec

FORMAT_VERSION = 1
DEFAULT_VOCAB_SIZE = 4096
DEFAULT_MAX_BYTES = 4 << 20
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_DOCUMENT_BREAK = re.compile(r"\n[ \t]*\n(?:[ \t]*\n)+")


@dataclass(frozen=True)
class EmbeddedCorpus:
    directory: str
    document_prefix: str  # GPT: one sequence per document, eod appended
    sentence_prefix: str  # BERT: one sequence per sentence, eod appended
    tokenizer: TokenizerSpec  # GPT2BPETokenizer over the trained vocab.json + merges.txt
    vocab_size: int  # special tokens included (trained into the vocabulary)


def collect_documents(max_bytes: int = DEFAULT_MAX_BYTES) -> List[str]:
    """The standard library's sources as documents, in a fixed order, about `max_bytes` of UTF-8."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _SKIP_DIRS]
        files += [os.path.relpath(os.path.join(directory, n), root) for n in names if n.endswith(".py")]
    documents, size = [], 0
    for rel in sorted(f.replace(os.sep, "/") for f in files):
        try:
            with open(os.path.join(root, rel), "rb") as f:
                text = f.read().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for doc in _DOCUMENT_BREAK.split(text):
            if doc.strip():
                documents.append(doc.strip("\n"))
                size += len(documents[-1].encode("utf-8"))
                if size >= max_bytes:
                    return documents
    return documents


def ensure_embedded_corpus(cache_dir: Optional[str] = None, vocab_size: int = DEFAULT_VOCAB_SIZE,
                           max_bytes: int = DEFAULT_MAX_BYTES) -> EmbeddedCorpus:
    """Build (first call) or reuse the embedded corpus; every rank may call this concurrently."""
    documents = collect_documents(max_bytes)
    if not documents:
        raise ValueError(f"no Python standard library sources found under {sysconfig.get_paths()['stdlib']}")
    key = hashlib.sha256(json.dumps([FORMAT_VERSION, vocab_size, documents]).encode()).hexdigest()[:16]
    root = os.path.join(cache_dir or default_cache_dir(), "embedded")
    directory = os.path.join(root, key)
    os.makedirs(root, exist_ok=True)
    with FileLock(os.path.join(root, ".megatron_moe.lock")):
        if not _verified(directory):
            _build(directory, documents, vocab_size)
    spec = TokenizerSpec("GPT2BPETokenizer", os.path.join(directory, "vocab.json"),
                         os.path.join(directory, "merges.txt"))
    return EmbeddedCorpus(directory, os.path.join(directory, "corpus_text_document"),
                          os.path.join(directory, "corpus_text_sentence"), spec, vocab_size)


def _build(directory: str, documents: List[str], vocab_size: int) -> None:
    tmp = f"{directory}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    train_bpe(tmp, vocab_size, texts=documents)
    jsonl = os.path.join(tmp, "corpus.jsonl")
    with open(jsonl, "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in documents)
    spec = TokenizerSpec("GPT2BPETokenizer", os.path.join(tmp, "vocab.json"), os.path.join(tmp, "merges.txt"))
    for split in (False, True):
        preprocess(jsonl, os.path.join(tmp, "corpus"), EncodeOptions(("text",), spec, append_eod=True,
                                                                     split_sentences=split), progress=False)
    os.remove(jsonl)
    files = sorted(n for n in os.listdir(tmp) if not n.startswith("."))
    with open(os.path.join(tmp, "manifest.json"), "w") as f:
        json.dump({"version": FORMAT_VERSION, "vocab_size": vocab_size, "documents": len(documents),
                   "sha256": {n: _sha256(os.path.join(tmp, n)) for n in files}}, f, indent=1)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)


def _verified(directory: str) -> bool:
    try:
        with open(os.path.join(directory, "manifest.json")) as f:
            sums = json.load(f)["sha256"]
        return all(_sha256(os.path.join(directory, n)) == s for n, s in sums.items())
    except (OSError, ValueError, KeyError):
        return False


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()
