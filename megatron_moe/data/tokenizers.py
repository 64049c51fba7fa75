"""Tokenizers registered under Megatron-LM's `--tokenizer-type` names (`data.tokenizer.type`).

All read local files only; nothing is ever downloaded. Every type exposes BERT's special tokens
(`cls`, `sep`, `mask`, `pad`) and an end-of-document token (`eod`): a special token the base
vocabulary already has keeps its id, a missing one is appended after the base vocabulary (in
`special_order`), as Megatron-LM does. Base-vocabulary ids are always Megatron-LM's, so corpora it
preprocessed carry over; so is GPT-2's eod (<|endoftext|> = 50256) and SentencePiece's appended
<CLS> <SEP> <EOD> <MASK> <PAD>. (Megatron-LM's BERT WordPiece appends [BOS] then [EOS] and uses
[EOS] as eod; here only [EOS] is appended.)
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from megatron_moe.config.validate import section_check
from megatron_moe.config.registry import Registry

TOKENIZERS: Registry = Registry("data.tokenizer.type")


@section_check("data.tokenizer.type")
def _check_tokenizer(cfg, world_size: int) -> None:
    if cfg.data.tokenizer.type is not None:
        TOKENIZERS.get(cfg.data.tokenizer.type)

# role -> token strings looked up in the base vocabulary, in order; the first one is appended if none exists
DEFAULT_SPECIALS = {
    "cls": ("[CLS]", "<cls>", "<CLS>"),
    "sep": ("[SEP]", "<sep>", "<SEP>"),
    "mask": ("[MASK]", "<mask>", "<MASK>"),
    "pad": ("[PAD]", "<pad>", "<PAD>"),
    "eod": ("<|endoftext|>", "[EOS]", "</s>", "<eos>", "<EOD>"),
}


def _require(path: Optional[str], flag: str, owner: str) -> str:
    if not path:
        raise ValueError(f"{owner} needs {flag}")
    if not os.path.exists(path):
        raise ValueError(f"{path}: not found ({flag} for {owner}; tokenizers are read from local files only)")
    return path


class Tokenizer:
    """Base class. Subclasses set up their backend, then call `_add_specials()`, and implement
    `tokenize(text) -> ids`, `_decode(ids) -> text`, `_lookup(token) -> id | None`, `base_vocab_size`."""

    special_order = ("cls", "sep", "mask", "pad", "eod")
    specials = DEFAULT_SPECIALS
    base_vocab_size: int

    def _add_specials(self) -> None:
        self.special_ids: Dict[str, int] = {}
        self.special_texts: Dict[str, str] = {}  # role -> the token's text
        appended: Dict[str, int] = {}  # token text -> id after the base vocabulary
        for role in self.special_order:
            text, found = next(((t, i) for t in self.specials[role] if (i := self._lookup(t)) is not None),
                               (self.specials[role][0], None))
            if found is None:
                found = appended.setdefault(text, self.base_vocab_size + len(appended))
            self.special_ids[role], self.special_texts[role] = found, text
        self._added = {i: text for text, i in appended.items()}

    @property
    def vocab_size(self) -> int:
        return self.base_vocab_size + len(self._added)

    def describe(self) -> str:
        """`4005 tokens: 4000 in the vocabulary + 5 appended (cls <CLS>=4000 ...)` (docs/data.md)."""
        specials = " ".join(f"{r} {self.special_texts[r]}={self.special_ids[r]}" for r in self.special_order)
        if not self._added:
            return f"{self.vocab_size} tokens, the specials in the vocabulary ({specials})"
        return (f"{self.vocab_size} tokens: {self.base_vocab_size} in the vocabulary + {len(self._added)} appended "
                f"specials ({specials})")

    cls = property(lambda self: self.special_ids["cls"])
    sep = property(lambda self: self.special_ids["sep"])
    mask = property(lambda self: self.special_ids["mask"])
    pad = property(lambda self: self.special_ids["pad"])
    eod = property(lambda self: self.special_ids["eod"])

    def encode(self, text: str) -> List[int]:
        """`tokenize(text)`: the ids training gave `text` (no eod appended)."""
        return self.tokenize(text)

    def decode(self, ids: Sequence[int]) -> str:
        """`detokenize(ids)`."""
        return self.detokenize(ids)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Inverse of `tokenize`; appended special tokens are rendered as their text."""
        out: List[str] = []
        run: List[int] = []
        for i in map(int, ids):
            if i in self._added:
                out += [self._decode(run), self._added[i]] if run else [self._added[i]]
                run = []
            else:
                run.append(i)
        if run:
            out.append(self._decode(run))
        return "".join(out)


class _HFBackend(Tokenizer):
    """Shared by the types backed by a Hugging Face `tokenizers.Tokenizer` (self._tok)."""

    add_special_tokens = False  # apply the tokenizer's own post-processor (BOS/EOS templates)?

    def _finish(self, tok) -> None:
        self._tok = tok
        self.base_vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self._add_specials()

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=self.add_special_tokens).ids

    def _decode(self, ids: List[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def _lookup(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)


@TOKENIZERS.register("GPT2BPETokenizer")
class GPT2BPETokenizer(_HFBackend):
    """GPT-2 byte-level BPE from `vocab.json` + `merges.txt` (same ids as Megatron-LM's / OpenAI's)."""

    def __init__(self, vocab_file=None, merge_file=None, tokenizer_model=None):
        from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

        vocab = _require(vocab_file, "a vocab file (--vocab-file, vocab.json)", "GPT2BPETokenizer")
        merges = _require(merge_file, "a merge file (--merge-file, merges.txt)", "GPT2BPETokenizer")
        try:
            tok = HFTokenizer(models.BPE.from_file(vocab, merges))
        except Exception as e:  # the Rust loader's message, on one line
            raise ValueError(f"{vocab} / {merges}: not a GPT-2 BPE vocabulary ({str(e).splitlines()[0]})") from None
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        self._finish(tok)


@TOKENIZERS.register("HuggingFaceTokenizer")
class HuggingFaceTokenizer(_HFBackend):
    """A local `tokenizer.json` (or a directory holding one, optionally with `special_tokens_map.json`).
    Like Megatron-LM, encoding applies the tokenizer's own post-processor (e.g. a BOS template)."""

    add_special_tokens = True
    _MAP_KEYS = {"cls": "cls_token", "sep": "sep_token", "mask": "mask_token", "pad": "pad_token", "eod": "eos_token"}

    def __init__(self, vocab_file=None, merge_file=None, tokenizer_model=None):
        from tokenizers import Tokenizer as HFTokenizer

        path = _require(tokenizer_model, "a tokenizer (--tokenizer-model: tokenizer.json or its directory)",
                        "HuggingFaceTokenizer")
        directory = path if os.path.isdir(path) else os.path.dirname(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise ValueError(f"{path}: no tokenizer.json in this directory (only the fast-tokenizer file format is read)")
        try:
            tok = HFTokenizer.from_file(file)
        except Exception as e:
            raise ValueError(f"{file}: not a Hugging Face tokenizer file ({str(e).splitlines()[0]})") from None
        self.specials = dict(DEFAULT_SPECIALS)
        mapping = os.path.join(directory, "special_tokens_map.json")
        if os.path.isfile(mapping):
            with open(mapping) as f:
                declared = json.load(f)
            for role, key in self._MAP_KEYS.items():
                value = declared.get(key)
                value = value.get("content") if isinstance(value, dict) else value
                if value:
                    self.specials[role] = (value,) + self.specials[role]
        self._finish(tok)


class _BertWordPiece(_HFBackend):
    """BERT WordPiece `vocab.txt` (needs [UNK] [CLS] [SEP] [PAD] [MASK]); no [CLS]/[SEP] added while
    tokenizing, as in Megatron-LM."""

    lowercase: bool
    specials = dict(DEFAULT_SPECIALS, eod=("[EOS]",))

    def __init__(self, vocab_file=None, merge_file=None, tokenizer_model=None):
        from tokenizers.implementations import BertWordPieceTokenizer

        name = type(self).__name__
        vocab = _require(vocab_file, "a vocab file (--vocab-file, vocab.txt)", name)
        try:
            tok = BertWordPieceTokenizer(vocab, lowercase=self.lowercase)
        except Exception as e:
            raise ValueError(f"{vocab}: not a BERT WordPiece vocabulary with [UNK] [CLS] [SEP] [PAD] [MASK] "
                             f"({str(e).splitlines()[0]})") from None
        self._finish(tok)


@TOKENIZERS.register("BertWordPieceLowerCase")
class BertWordPieceLowerCase(_BertWordPiece):
    """BERT uncased WordPiece (`vocab.txt`): lower-cases and strips accents."""

    lowercase = True


@TOKENIZERS.register("BertWordPieceCase")
class BertWordPieceCase(_BertWordPiece):
    """BERT cased WordPiece (`vocab.txt`)."""

    lowercase = False


@TOKENIZERS.register("SentencePieceTokenizer")
class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece `.model`. Missing specials are appended as Megatron-LM does: <CLS> <SEP> <EOD>
    <MASK>, then the model's pad piece or <PAD>."""

    special_order = ("cls", "sep", "eod", "mask", "pad")

    def __init__(self, vocab_file=None, merge_file=None, tokenizer_model=None):
        import sentencepiece as spm

        model = _require(tokenizer_model, "a model (--tokenizer-model, *.model)", "SentencePieceTokenizer")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=model)
        except Exception as e:
            raise ValueError(f"{model}: not a SentencePiece model ({str(e).splitlines()[0]})") from None
        self.base_vocab_size = self._sp.get_piece_size()
        pad_id = self._sp.pad_id()
        pad = (self._sp.id_to_piece(pad_id),) if pad_id >= 0 else ("<PAD>",)
        self.specials = {"cls": ("<CLS>",), "sep": ("<SEP>",), "eod": ("<EOD>",), "mask": ("<MASK>",), "pad": pad}
        self._add_specials()

    def tokenize(self, text: str) -> List[int]:
        return self._sp.encode(text, out_type=int)

    def _decode(self, ids: List[int]) -> str:
        return self._sp.decode(ids)

    def _lookup(self, token: str) -> Optional[int]:
        i = self._sp.piece_to_id(token)
        return i if self._sp.id_to_piece(i) == token else None


@TOKENIZERS.register("ByteTokenizer")
class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255 (no files); the specials follow as 256..260."""

    base_vocab_size = 256

    def __init__(self, vocab_file=None, merge_file=None, tokenizer_model=None):
        self._add_specials()

    def tokenize(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def _decode(self, ids: List[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def _lookup(self, token: str) -> Optional[int]:
        return None


def build_tokenizer(tokenizer_type: str, vocab_file: Optional[str] = None, merge_file: Optional[str] = None,
                    tokenizer_model: Optional[str] = None) -> Tokenizer:
    """The tokenizer registered as `tokenizer_type` (Megatron-LM's names), built from local files."""
    return TOKENIZERS.get(tokenizer_type)(vocab_file=vocab_file, merge_file=merge_file,
                                          tokenizer_model=tokenizer_model)


MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128  # Megatron-LM's --make-vocab-size-divisible-by default


def recommended_vocab_size(size: int) -> int:
    """The `model.vocab_size` docs/data.md recommends for a tokenizer of `size` tokens: `size` rounded
    up to a multiple of 128, as Megatron-LM pads its vocabulary."""
    return -(-size // MAKE_VOCAB_SIZE_DIVISIBLE_BY) * MAKE_VOCAB_SIZE_DIVISIBLE_BY


@dataclass(frozen=True)
class TokenizerSpec:
    """What `build_tokenizer` needs (mirrors `data.tokenizer.*`); picklable, for worker processes."""

    type: str
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_model: Optional[str] = None

    def build(self) -> Tokenizer:
        return build_tokenizer(self.type, self.vocab_file, self.merge_file, self.tokenizer_model)


# -- the tokenizer a checkpoint carries (docs/checkpoints.md) ----------------------------------------
CHECKPOINT_TOKENIZER = "tokenizer"  # subdirectory of a checkpoint: copies of the files + SPEC_FILE
SPEC_FILE = "tokenizer_spec.json"
HF_SPECIAL_MAP = "special_tokens_map.json"  # HuggingFaceTokenizer's declared specials, copied beside tokenizer.json
# fixed names of the copies, by (type, TokenizerSpec field); other types keep their files' names
_COPY_NAMES = {("GPT2BPETokenizer", "vocab_file"): "vocab.json", ("GPT2BPETokenizer", "merge_file"): "merges.txt",
               ("BertWordPieceLowerCase", "vocab_file"): "vocab.txt", ("BertWordPieceCase", "vocab_file"): "vocab.txt",
               ("SentencePieceTokenizer", "tokenizer_model"): "tokenizer.model",
               ("HuggingFaceTokenizer", "tokenizer_model"): "tokenizer.json"}
_SPEC_FIELDS = ("vocab_file", "merge_file", "tokenizer_model")
_TRAINING: Dict[str, "TokenizerSpec"] = {}  # data section -> the tokenizer this process's datasets used


def _data_key(cfg) -> str:
    d = cfg.data
    return repr((d.path, d.tokenizer, d.cache_dir, d.embedded_vocab_size))


def record_training_tokenizer(cfg, spec: "TokenizerSpec") -> None:
    """Called where the datasets are built (`datasets.data_source`): the tokenizer of `cfg`'s data,
    which `training_tokenizer` hands to every checkpoint save of this process."""
    _TRAINING[_data_key(cfg)] = spec


def training_tokenizer(cfg) -> Optional["TokenizerSpec"]:
    """The tokenizer this process built `cfg`'s datasets with; None when it built none (synthetic
    data in tests): such a checkpoint carries no tokenizer."""
    return _TRAINING.get(_data_key(cfg))


def write_checkpoint_tokenizer(source, directory: str, origin: Optional[str] = None) -> None:
    """`directory` (a checkpoint's `tokenizer/`) from `source`: a TokenizerSpec (its files copied
    under fixed names, described by SPEC_FILE) or another checkpoint's `tokenizer/` (copied as it is)."""
    if isinstance(source, str):
        shutil.copytree(source, directory)
        return
    os.makedirs(directory)
    names, origins = {}, {}
    for key in _SPEC_FIELDS:
        path = getattr(source, key)
        if not path:
            continue
        if key == "tokenizer_model" and os.path.isdir(path):  # HuggingFaceTokenizer: tokenizer.json's directory
            path = os.path.join(path, "tokenizer.json")
        names[key] = _COPY_NAMES.get((source.type, key), os.path.basename(path))
        shutil.copyfile(path, os.path.join(directory, names[key]))
        origins[key] = os.path.abspath(path)
    mapping = os.path.join(os.path.dirname(origins.get("tokenizer_model", "")), HF_SPECIAL_MAP)
    if source.type == "HuggingFaceTokenizer" and os.path.isfile(mapping):
        shutil.copyfile(mapping, os.path.join(directory, HF_SPECIAL_MAP))
    tok = source.build()
    with open(os.path.join(directory, SPEC_FILE), "w") as f:
        json.dump({"type": source.type, **names, "vocab_size": tok.vocab_size, "special_ids": tok.special_ids,
                   "origin": origin or origins}, f, indent=1, sort_keys=True)


def read_checkpoint_tokenizer(directory: str) -> "TokenizerSpec":
    """The TokenizerSpec of a checkpoint's `tokenizer/` directory (its paths: the copies)."""
    with open(os.path.join(directory, SPEC_FILE)) as f:
        spec = json.load(f)
    return TokenizerSpec(spec["type"], **{k: os.path.join(directory, spec[k]) for k in _SPEC_FIELDS if spec.get(k)})
