"""A checkpoint's tokenizer <-> Hugging Face tokenizer files (docs/checkpoints.md, "The tokenizer").

export-hf writes `tokenizer.json` (a `tokenizers.Tokenizer` that encodes every text to the ids the
data pipeline's tokenizer gives it, data/tokenizers.py), `tokenizer_config.json` and
`special_tokens_map.json` (eos = the pipeline's eod, pad, cls / sep / mask, bos and unk where the
tokenizer has them), `generation_config.json` (eos / pad / bos ids), and for SentencePiece the
`tokenizer.model` itself, so `AutoTokenizer.from_pretrained(export)` needs no hand work:

* GPT2BPETokenizer (and the embedded corpus's trained BPE), BertWordPiece*, HuggingFaceTokenizer:
  the tokenizer object the pipeline uses, serialized; BERT's [CLS]/[SEP] template dropped (the
  pipeline tokenizes without it), HuggingFaceTokenizer's post-processor kept (the pipeline applies it);
* SentencePieceTokenizer (BPE or unigram): converted from the model proto (pieces, scores,
  normalizer rules, byte fallback);
* ByteTokenizer: a byte-level BPE without merges whose id of a byte is the byte.

Specials the pipeline appends after the base vocabulary (data/tokenizers.py) are added tokens with
the same ids. `split_special_tokens` is set where the pipeline's tokenizer reads every special token's
text as plain text (`splits_specials`), so the literal text encodes as in training. Two cases differ
(docs/checkpoints.md): the literal text of a special appended by the pipeline to a tokenizer that
matches its own specials in text (BERT, tokenizer.json) encodes as that special in the export, and
a unigram SentencePiece model's control piece text (`<s>`) encodes as that piece. Decoding ids
with specials inside may differ in the spaces around them (each side's decoder joins them).
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Optional

from megatron_moe.data.tokenizers import (HF_SPECIAL_MAP, ByteTokenizer, HuggingFaceTokenizer, SentencePieceTokenizer,
                                          Tokenizer, TokenizerSpec, _HFBackend)

# the files an export of ours may hold besides its weights and config.json (hf_common.is_export)
FILES = ("tokenizer.json", "tokenizer_config.json", HF_SPECIAL_MAP, "generation_config.json", "tokenizer.model")
_ROLES = {"eod": "eos_token", "pad": "pad_token", "cls": "cls_token", "sep": "sep_token", "mask": "mask_token"}


def hf_backend(tok: Tokenizer):
    """A `tokenizers.Tokenizer` that encodes (with its default add_special_tokens) and decodes as
    `tok` does; ValueError, one line, when `tok` has no such form."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer

    if isinstance(tok, _HFBackend):
        spec = json.loads(tok._tok.to_str())
        if not tok.add_special_tokens:
            spec["post_processor"] = None  # e.g. BERT's [CLS] ... [SEP]: the pipeline tokenizes without it
        backend = HFTokenizer.from_str(json.dumps(spec))
    elif isinstance(tok, SentencePieceTokenizer):
        backend = _from_sentencepiece(tok._sp)
    elif isinstance(tok, ByteTokenizer):
        backend = _bytes_backend()
    else:
        raise ValueError(f"{type(tok).__name__} has no Hugging Face tokenizer.json form")
    for i, text in sorted(tok._added.items()):  # appended specials: the next ids, in order
        backend.add_special_tokens([AddedToken(text, special=True, normalized=False)])
        if backend.token_to_id(text) != i:
            raise ValueError(f"{type(tok).__name__}: appended special {text} would get id "
                             f"{backend.token_to_id(text)} instead of {i}")
    return backend


def _bytes_backend():
    """Byte i <-> id i: GPT-2's byte-to-character table as a BPE vocabulary without merges."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]  # GPT-2 bytes_to_unicode
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b], extra = chr(256 + extra), extra + 1
    backend = HFTokenizer(models.BPE({chars[b]: b for b in range(256)}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def _from_sentencepiece(sp):
    """The SentencePiece model of processor `sp` as a `tokenizers.Tokenizer` (BPE or unigram)."""
    from sentencepiece import sentencepiece_model_pb2 as pb
    from tokenizers import Regex, Tokenizer as HFTokenizer, decoders, models, normalizers

    proto = pb.ModelProto()
    proto.ParseFromString(sp.serialized_model_proto())
    trainer, norm, piece = proto.trainer_spec, proto.normalizer_spec, pb.ModelProto.SentencePiece
    kind = pb.TrainerSpec.ModelType.Name(trainer.model_type)
    if kind not in ("BPE", "UNIGRAM"):
        raise ValueError(f"a SentencePiece {kind.lower()} model has no tokenizer.json form (bpe and unigram do)")
    if any(p.type == piece.USER_DEFINED for p in proto.pieces) or trainer.treat_whitespace_as_suffix \
            or not norm.escape_whitespaces or trainer.allow_whitespace_only_pieces:
        raise ValueError("a SentencePiece model with user-defined symbols, whitespace as suffix, unescaped or "
                         "whitespace-only pieces has no exact tokenizer.json form")
    pieces = [(p.piece, p.score, p.type) for p in proto.pieces]
    unk = trainer.unk_id
    if kind == "BPE":
        normal = {text: i for i, (text, _, t) in enumerate(pieces) if t == piece.NORMAL}
        merges = []  # SentencePiece merges the adjacent pair whose result scores highest: rank by that
        for i in sorted(normal.values(), key=lambda i: (-pieces[i][1], i)):
            text = pieces[i][0]
            merges += sorted(((text[:k], text[k:]) for k in range(1, len(text))
                              if text[:k] in normal and text[k:] in normal), key=lambda lr: (normal[lr[0]], normal[lr[1]]))
        model = models.BPE({text: i for i, (text, _, _) in enumerate(pieces)}, merges, unk_token=pieces[unk][0],
                           fuse_unk=True, byte_fallback=trainer.byte_fallback)
    else:  # unigram: pieces that never match text (control, unused) scored out of reach
        low = min(score for _, score, t in pieces if t == piece.NORMAL) - 1e4
        model = models.Unigram([(text, score if t in (piece.NORMAL, piece.BYTE) else low) for text, score, t in pieces],
                               unk_id=unk, byte_fallback=trainer.byte_fallback)
    backend = HFTokenizer(model)
    steps = [normalizers.Precompiled(norm.precompiled_charsmap)] if norm.precompiled_charsmap else []
    if norm.remove_extra_whitespaces:
        steps += [normalizers.Replace(Regex("^ +| +$"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if norm.add_dummy_prefix:
        steps.append(normalizers.Prepend(" "))
    backend.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "\u2581")])
    decode = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(decode + ([decoders.Strip(" ", 1, 0)] if norm.add_dummy_prefix else []))
    for i, (text, _, t) in enumerate(pieces):  # control / unknown pieces: decoded by name, never matched in text
        if t in (piece.CONTROL, piece.UNKNOWN):
            backend.add_special_tokens([text])
    return backend


def splits_specials(tok: Tokenizer) -> bool:
    """Whether the pipeline's tokenizer reads every special token's text as plain text: its backend
    has no added tokens (GPT-2 BPE, SentencePiece, bytes; BERT WordPiece and tokenizer.json files
    have theirs, matched in text)."""
    return not (isinstance(tok, _HFBackend) and tok._tok.get_added_tokens_decoder())


def extra_specials(spec: TokenizerSpec, tok: Tokenizer) -> dict:
    """bos / unk tokens of the tokenizer itself (the pipeline has no such role): `{"bos_token": text,
    "unk_token": text}` where it has them, as the export declares them (and the lm-eval backend's
    prefix token reads them)."""
    out = {}
    if isinstance(tok, SentencePieceTokenizer):
        for key, i in (("bos_token", tok._sp.bos_id()), ("unk_token", tok._sp.unk_id())):
            if i >= 0:
                out[key] = tok._sp.id_to_piece(i)
    elif isinstance(tok, HuggingFaceTokenizer):
        mapping = os.path.join(os.path.dirname(spec.tokenizer_model), HF_SPECIAL_MAP)
        if os.path.isfile(mapping):
            with open(mapping) as f:
                declared = json.load(f)
            for key in ("bos_token", "unk_token"):
                value = declared.get(key)
                value = value.get("content") if isinstance(value, dict) else value
                if value and tok._lookup(value) is not None:
                    out[key] = value
    elif isinstance(tok, _HFBackend) and tok._lookup("[UNK]") is not None:
        out["unk_token"] = "[UNK]"
    return out


def write_hf_tokenizer(spec: TokenizerSpec, out_dir: str, model_max_length: int) -> None:
    """The Hugging Face files of tokenizer `spec` into `out_dir` (ValueError if it has no such form)."""
    tok = spec.build()
    backend = hf_backend(tok)
    specials = {_ROLES[role]: tok.special_texts[role] for role in _ROLES}
    specials.update(extra_specials(spec, tok))
    backend.save(os.path.join(out_dir, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": False, "split_special_tokens": splits_specials(tok),
              **specials}
    ids = {"eos_token_id": tok.eod, "pad_token_id": tok.pad}
    if "bos_token" in specials:
        ids["bos_token_id"] = backend.token_to_id(specials["bos_token"])
    for name, content in (("tokenizer_config.json", config), (HF_SPECIAL_MAP, specials),
                          ("generation_config.json", dict(ids, _from_model_config=False))):
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(content, f, indent=2, sort_keys=True)
    if isinstance(tok, SentencePieceTokenizer):
        shutil.copyfile(spec.tokenizer_model, os.path.join(out_dir, "tokenizer.model"))


def export_tokenizer(checkpoint: str, out_dir: str, model_max_length: int) -> Optional[str]:
    """Write checkpoint `checkpoint`'s tokenizer into export `out_dir`; the reason, one line, when
    there is none to write (nothing is written then)."""
    from megatron_moe.training.checkpoint_tokenizer import checkpoint_tokenizer_spec

    try:
        spec = checkpoint_tokenizer_spec(checkpoint)
        write_hf_tokenizer(spec, out_dir, model_max_length)
    except ValueError as exc:
        for name in FILES:
            if os.path.exists(os.path.join(out_dir, name)):
                os.remove(os.path.join(out_dir, name))
        return str(exc)
    return None


def import_tokenizer(hf_dir: str) -> Optional[TokenizerSpec]:
    """The tokenizer of a Hugging Face directory, for import-hf to copy into the checkpoint:
    `tokenizer.json` (HuggingFaceTokenizer, with `special_tokens_map.json`) or else a SentencePiece
    `tokenizer.model`; None when it has neither."""
    if os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):
        return TokenizerSpec("HuggingFaceTokenizer", tokenizer_model=os.path.join(hf_dir, "tokenizer.json"))
    if os.path.isfile(os.path.join(hf_dir, "tokenizer.model")):
        return TokenizerSpec("SentencePieceTokenizer", tokenizer_model=os.path.join(hf_dir, "tokenizer.model"))
    return None
