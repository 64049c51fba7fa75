"""Train tokenizers on local text: GPT-2-style byte-level BPE (Hugging Face `tokenizers`) or a
SentencePiece model. Used by `tools/train_tokenizer.py` and the embedded demo corpus."""
from __future__ import annotations

import os
from typing import Iterable, List, Optional, Sequence

# Trained into the vocabulary so every tokenizer type finds them without appending ids.
BPE_SPECIAL_TOKENS = ("<|endoftext|>", "[CLS]", "[SEP]", "[MASK]", "[PAD]")


def text_files(inputs: Sequence[str], json_keys: Sequence[str], scratch_dir: str) -> List[str]:
    """The files a tokenizer learns from: plain text files as they are; a file of documents (jsonl,
    json, parquet, csv, arrow) as the text under its `json_keys`, read as `tools/preprocess_data.py`
    reads it (never its JSON syntax), written to `scratch_dir`. Bad input: ValueError, one line."""
    from megatron_moe.data.preprocess import is_document_file, read_texts

    out = []
    for i, path in enumerate(inputs):
        if not is_document_file(path):
            out.append(path)
            continue
        out.append(os.path.join(scratch_dir, f"input{i:03d}.txt"))
        with open(out[-1], "w", encoding="utf-8") as f:
            for text in read_texts(path, json_keys, scratch_dir):
                f.write(text if text.endswith("\n") else text + "\n")
    return out


def train_bpe(out_dir: str, vocab_size: int, files: Optional[Sequence[str]] = None,
              texts: Optional[Iterable[str]] = None, min_frequency: int = 2,
              special_tokens: Sequence[str] = BPE_SPECIAL_TOKENS) -> dict:
    """Byte-level BPE on `files` or an iterable of `texts`; writes `vocab.json` + `merges.txt`
    (GPT2BPETokenizer) and `tokenizer.json` (HuggingFaceTokenizer) into `out_dir`. Deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                  special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    if files is not None:
        tok.train(list(files), trainer)
    else:
        tok.train_from_iterator(texts, trainer)
    os.makedirs(out_dir, exist_ok=True)
    vocab_file, merge_file = tok.model.save(out_dir)
    tokenizer_json = os.path.join(out_dir, "tokenizer.json")
    tok.save(tokenizer_json)
    return {"vocab_file": vocab_file, "merge_file": merge_file, "tokenizer_json": tokenizer_json}


def train_sentencepiece(model_prefix: str, vocab_size: int, files: Optional[Sequence[str]] = None,
                        texts: Optional[Iterable[str]] = None, model_type: str = "bpe") -> str:
    """SentencePiece (`bpe` or `unigram`) on `files` or `texts`; writes `<model_prefix>.model`.
    Lossless like Llama's: no normalization, whitespace kept, unknown characters as UTF-8 bytes."""
    import sentencepiece as spm

    source = {"input": ",".join(files)} if files is not None else {"sentence_iterator": iter(texts)}
    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    try:
        spm.SentencePieceTrainer.train(model_prefix=model_prefix, vocab_size=vocab_size, model_type=model_type,
                                       character_coverage=1.0, byte_fallback=True,
                                       normalization_rule_name="identity", remove_extra_whitespaces=False,
                                       num_threads=os.cpu_count() or 1, minloglevel=2, **source)
    except RuntimeError as e:  # e.g. "Vocabulary size is smaller than required_chars. 280 vs 308. ..."
        raise ValueError(f"sentencepiece training failed: {str(e).splitlines()[0]}") from None
    return model_prefix + ".model"
