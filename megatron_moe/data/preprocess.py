"""Corpus -> Megatron indexed datasets (`tools/preprocess_data.py` is the command line).

The input is cut into `workers` contiguous shards (byte ranges of a jsonl file, row ranges of a
Hugging Face `datasets` table); each worker tokenizes its shard into a partial `.bin`/`.idx`, and the
parts are concatenated in shard order. Documents keep their input order, so the output bytes do not
depend on the number of workers. One output per json key: `<prefix>_<key>_document` (`_sentence`
with sentence splitting), as Megatron-LM names them.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import shutil
import sys
import tempfile
import time
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import Dict, Iterator, List, Sequence, Tuple

from megatron_moe.data import indexed
from megatron_moe.data.tokenizers import TokenizerSpec
from megatron_moe.perf import timing

HF_FORMATS = {".json": "json", ".parquet": "parquet", ".txt": "text", ".csv": "csv", ".arrow": "arrow"}
# documents under json keys: json lines, and every HF_FORMATS format but plain text
DOCUMENT_FORMATS = (".jsonl", ".ndjson", *(ext for ext in HF_FORMATS if ext != ".txt"))


class InputError(ValueError):
    """Bad input at `where` (a byte offset into a jsonl file, or a row index); `preprocess` turns it
    into `file:line: problem`."""

    def __init__(self, where: int, problem: str):
        super().__init__(where, problem)
        self.where, self.problem = where, problem


# ---------------------------------------------------------------- sentence splitting (rule based)

_ABBREVIATIONS = {"mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "etc", "e.g", "i.e", "no", "fig", "al"}
_BOUNDARY = re.compile(r"""(?P<end>(?<=[.!?])["')\]]*\s+(?=["'(\[]?(?P<next>\w)))|\n\s*\n""")


def split_sentences(text: str, keep_newlines: bool = False) -> List[str]:
    """Sentences of `text`: a break after . ! ? (and closing quotes/brackets) followed by whitespace
    and a capital or digit, unless the word before the period is a known abbreviation or a single
    letter; blank lines always break. Whitespace between sentences stays with the earlier one when
    `keep_newlines`, else sentences are stripped (Megatron-LM's nltk splitter behaves alike)."""
    pieces, start = [], 0
    for m in _BOUNDARY.finditer(text):
        if m.group("end") is not None and m.group().count("\n") < 2:  # not also a blank line
            if not (m.group("next").isupper() or m.group("next").isdigit()):
                continue
            last_word = text[start:m.start()].rsplit(None, 1)[-1].rstrip(".!?").lower()
            if last_word in _ABBREVIATIONS or len(last_word) == 1 and last_word.isalpha():
                continue
        pieces.append(text[start:m.end()])
        start = m.end()
    pieces.append(text[start:])
    if not keep_newlines:
        pieces = [p.strip() for p in pieces]
    return [p for p in pieces if p.strip()]


# ---------------------------------------------------------------- input sources

class JsonlSource:
    """A JSON-lines file read in byte-range shards; a line belongs to the shard holding its first byte."""

    def __init__(self, path: str):
        self.path, self.total = path, os.path.getsize(path)

    def shard(self, index: int, count: int) -> Iterator[Tuple[int, dict, int]]:
        """Yields (byte offset, document, bytes consumed)."""
        start, end = self.total * index // count, self.total * (index + 1) // count
        with open(self.path, "rb") as f:
            if start > 0:
                f.seek(start - 1)
                f.readline()  # finish the line that began in the previous shard
            pos = f.tell()
            while pos < end:
                line = f.readline()
                if not line:
                    break
                if line.strip():
                    try:
                        doc = json.loads(line)
                    except (json.JSONDecodeError, UnicodeDecodeError) as e:
                        raise InputError(pos, f"not valid JSON ({e})") from None
                    if not isinstance(doc, dict):
                        raise InputError(pos, f"expected a JSON object, got {type(doc).__name__}")
                    yield pos, doc, len(line)
                pos += len(line)

    def describe(self, where: int) -> str:
        with open(self.path, "rb") as f:
            line = f.read(where).count(b"\n") + 1
        return f"{self.path}:{line}"


class HFSource:
    """json/parquet/txt/csv/arrow through Hugging Face `datasets` (offline, local files only), read in
    row-range shards. txt: one document per line under the key `text`."""

    def __init__(self, path: str, cache_dir: str):
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            import datasets
        except ImportError:
            raise ValueError(f"{path}: reading {os.path.splitext(path)[1]} files needs the `datasets` package "
                             "(pip install datasets); jsonl needs nothing") from None
        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()
        builder = HF_FORMATS[os.path.splitext(path)[1].lower()]
        try:
            self.table = datasets.load_dataset(builder, data_files=os.path.abspath(path), split="train",
                                               cache_dir=cache_dir)
        except Exception as e:
            raise ValueError(f"{path}: cannot be read as {builder} ({str(e).splitlines()[0]})") from None
        self.path, self.total = path, len(self.table)

    def shard(self, index: int, count: int) -> Iterator[Tuple[int, dict, int]]:
        start, end = self.total * index // count, self.total * (index + 1) // count
        row = start
        for batch in self.table.select(range(start, end)).iter(batch_size=1000):
            for values in zip(*batch.values()):
                yield row, dict(zip(batch.keys(), values)), 1
                row += 1

    def describe(self, where: int) -> str:
        return f"{self.path}: row {where + 1}"


def open_source(path: str, scratch_dir: str):
    if not os.path.isfile(path):
        raise ValueError(f"{path}: input file not found")
    ext = os.path.splitext(path)[1].lower()
    if ext in (".jsonl", ".ndjson") or ext == ".json" and not _starts_with_bracket(path):
        return JsonlSource(path)
    if ext not in HF_FORMATS:
        raise ValueError(f"{path}: unknown input format {ext!r} (jsonl, {', '.join(sorted(HF_FORMATS))})")
    return HFSource(path, os.path.join(scratch_dir, "hf_cache"))


def _starts_with_bracket(path: str) -> bool:
    """A .json file holding one JSON array (not JSON lines)."""
    with open(path, "rb") as f:
        return f.read(4096).lstrip().startswith(b"[")


# ---------------------------------------------------------------- encoding

def document_text(doc: dict, key: str, where: int) -> str:
    """The string under `key` of one input document (InputError if it has none)."""
    if key not in doc:
        raise InputError(where, f"no key {key!r} (keys: {sorted(doc)})")
    text = doc[key]
    if not isinstance(text, str):
        raise InputError(where, f"key {key!r} holds {type(text).__name__}, expected a string")
    return text


def read_texts(input_path: str, json_keys: Sequence[str], scratch_dir: str) -> Iterator[str]:
    """The strings under `json_keys` of every document of `input_path`, in input order, read as
    `preprocess` reads them (`tools/train_tokenizer.py` learns from these). Bad input: ValueError,
    one line `file:line: problem`."""
    source = open_source(input_path, scratch_dir)
    try:
        for where, doc, _ in source.shard(0, 1):
            for key in json_keys:
                yield document_text(doc, key, where)
    except InputError as e:
        raise ValueError(f"{source.describe(e.where)}: {e.problem}") from None


def is_document_file(path: str) -> bool:
    """Does `path` hold documents under keys (jsonl, json, parquet, csv, arrow), not plain text?"""
    return os.path.splitext(path)[1].lower() in DOCUMENT_FORMATS


@dataclass(frozen=True)
class EncodeOptions:
    json_keys: Tuple[str, ...]
    tokenizer: TokenizerSpec
    append_eod: bool = False
    split_sentences: bool = False
    keep_newlines: bool = False


def encode_document(doc: dict, opts: EncodeOptions, tokenizer, where: int) -> Dict[str, Tuple[List[int], List[int]]]:
    """{key: (token ids, sequence lengths)}: one sequence per non-empty sentence (or per document),
    eod appended to the last one (Megatron-LM's Encoder.encode)."""
    out = {}
    for key in opts.json_keys:
        text = document_text(doc, key, where)
        pieces = split_sentences(text, opts.keep_newlines) if opts.split_sentences else [text]
        ids: List[int] = []
        lengths: List[int] = []
        for piece in pieces:
            piece_ids = tokenizer.tokenize(piece)
            if piece_ids:
                ids += piece_ids
                lengths.append(len(piece_ids))
        if ids and opts.append_eod:
            ids.append(tokenizer.eod)
            lengths[-1] += 1
        out[key] = (ids, lengths)
    return out


def output_prefix_for(output_prefix: str, key: str, split: bool) -> str:
    return f"{output_prefix}_{key}_{'sentence' if split else 'document'}"


_progress_counters = None  # per-worker [docs, units] in shared memory, set in each pool worker


def _init_worker(counters) -> None:
    global _progress_counters
    _progress_counters = counters


def _encode_shard(source, index: int, count: int, opts: EncodeOptions, part_prefix: str, report=None) -> int:
    """Tokenize shard `index` of `count` into `<part_prefix>_<key>...`; returns its document count."""
    tokenizer = opts.tokenizer.build()
    dtype = indexed.dtype_for_vocab(tokenizer.vocab_size)
    builders = {k: indexed.IndexedDatasetBuilder(output_prefix_for(part_prefix, k, opts.split_sentences), dtype)
                for k in opts.json_keys}
    docs = units = 0
    for where, doc, consumed in source.shard(index, count):
        for key, (ids, lengths) in encode_document(doc, opts, tokenizer, where).items():
            builders[key].add_document(ids, lengths)
        docs, units = docs + 1, units + consumed
        if report is not None:
            report(docs, units)
        elif _progress_counters is not None:
            _progress_counters[2 * index], _progress_counters[2 * index + 1] = docs, units
    for b in builders.values():
        b.finalize()
    return docs


# ---------------------------------------------------------------- progress

class Progress:
    """`[#####.....]  52.0%  1,234 docs  410 docs/s  ETA 00:00:03` on stderr, redrawn at most every
    `interval` seconds (a new line every >= 5 s when stderr is not a terminal)."""

    def __init__(self, total_units: int, interval: float = 0.5, stream=None, enabled: bool = True):
        self.stream = stream or sys.stderr
        self.enabled, self.tty = enabled, self.stream.isatty()
        self.total = max(total_units, 1)  # bytes of a jsonl file, rows of a table
        self.interval = interval if self.tty else max(interval, 5.0)
        self.watch = timing.Stopwatch()  # host-only work
        self.last = 0.0

    def update(self, docs: int, units: int, final: bool = False) -> None:
        now = self.watch.seconds()
        if not self.enabled or (not final and now - self.last < self.interval):
            return
        self.last, elapsed = now, max(now, 1e-9)
        frac = min(units / self.total, 1.0)
        eta = elapsed * (1 - frac) / frac if frac > 0 else 0.0
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        line = (f"[{bar}] {100 * frac:5.1f}%  {docs:,} docs  {docs / elapsed:,.0f} docs/s  "
                f"ETA {time.strftime('%H:%M:%S', time.gmtime(eta))}")
        self.stream.write(("\r" + line + ("\n" if final else "")) if self.tty else line + "\n")
        self.stream.flush()


# ---------------------------------------------------------------- driver

def preprocess(input_path: str, output_prefix: str, opts: EncodeOptions, workers: int = 1,
               progress: bool = True) -> Dict[str, str]:
    """Tokenize `input_path` into one indexed dataset per json key; returns {key: output prefix}.
    Raises ValueError with one line (`file:line: problem` for bad input)."""
    if workers < 1:
        raise ValueError(f"--workers must be >= 1 (got {workers})")
    opts.tokenizer.build()  # fail early, in this process, on a bad tokenizer spec
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".preprocess-", dir=out_dir)
    try:
        source = open_source(input_path, scratch)
        parts = [os.path.join(scratch, f"part{i:05d}") for i in range(workers)]
        bar = Progress(source.total, enabled=progress)
        try:
            docs = _run_shards(source, opts, parts, bar)
        except InputError as e:
            raise ValueError(f"{source.describe(e.where)}: {e.problem}") from None
        if docs == 0:
            raise ValueError(f"{input_path}: no documents (the input is empty)")
        outputs = {}
        for key in opts.json_keys:
            out = outputs[key] = output_prefix_for(output_prefix, key, opts.split_sentences)
            inputs = [output_prefix_for(p, key, opts.split_sentences) for p in parts]
            if len(inputs) == 1:
                for path_of in (indexed.bin_path, indexed.idx_path):
                    os.replace(path_of(inputs[0]), path_of(out))
            else:
                indexed.merge_datasets(inputs, out)
        return outputs
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run_shards(source, opts: EncodeOptions, parts: Sequence[str], bar: Progress) -> int:
    n = len(parts)
    if n == 1:
        docs = _encode_shard(source, 0, 1, opts, parts[0], report=bar.update)
        bar.update(docs, source.total, final=True)
        return docs
    # fork: workers start at once (no re-imports); the parent has only loaded the tokenizer, never run
    # its thread pool, so forking is safe. spawn where fork does not exist.
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    counters = ctx.Array("q", 2 * n, lock=False)
    # A pool that raises BrokenProcessPool (instead of hanging) if a worker dies.
    with ProcessPoolExecutor(n, mp_context=ctx, initializer=_init_worker, initargs=(counters,)) as pool:
        futures = [pool.submit(_encode_shard, source, i, n, opts, parts[i]) for i in range(n)]
        while True:
            done, pending = wait(futures, timeout=0.2, return_when=FIRST_EXCEPTION)
            if not pending or any(f.exception() for f in done):
                break
            bar.update(sum(counters[0::2]), sum(counters[1::2]))
        docs = sum(f.result() for f in futures)
    bar.update(docs, source.total, final=True)
    return docs
