"""Train a tokenizer on local text files or a corpus of documents.

    python tools/train_tokenizer.py --type bpe --input a.txt b.txt --vocab-size 8000 --output-dir tok/
        -> tok/vocab.json + tok/merges.txt (--tokenizer-type GPT2BPETokenizer) and
           tok/tokenizer.json (--tokenizer-type HuggingFaceTokenizer)
    python tools/train_tokenizer.py --type sentencepiece --input docs.jsonl --json-keys text \\
        --vocab-size 8000 --output-dir tok/
        -> tok/spm.model (--tokenizer-type SentencePieceTokenizer)

--input: plain text files as they are; JSON lines (or json / parquet / csv / arrow) are read as
tools/preprocess_data.py reads them: the text under --json-keys, never the JSON around it.
Prints each tokenizer type's size with its special tokens and the model.vocab_size to use.
--output-dir is written as a whole beside itself and renamed into place when complete (a crash or
an error leaves the previous one); a directory holding other files is refused. User errors: one
line, exit 2.
"""
import argparse
import os
import sys
import tempfile

from megatron_moe.convert.offline import replace_output
from megatron_moe.data.tokenizer_training import text_files, train_bpe, train_sentencepiece
from megatron_moe.data.tokenizers import build_tokenizer, recommended_vocab_size

OUTPUTS = ("vocab.json", "merges.txt", "tokenizer.json", "spm.model", "spm.vocab")  # what a training writes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--type", choices=["bpe", "sentencepiece"], default="bpe")
    p.add_argument("--input", nargs="+", required=True, help="local text files, or jsonl/json/parquet/csv/arrow")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys whose text is learned (jsonl etc.)")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--min-frequency", type=int, default=2, help="bpe: least count of a merged pair")
    p.add_argument("--sentencepiece-model-type", choices=["bpe", "unigram"], default="bpe")
    args = p.parse_args(argv)
    for f in args.input:
        if not os.path.isfile(f):
            print(f"error: {f}: input file not found", file=sys.stderr)
            return 2
    others = sorted(set(os.listdir(args.output_dir)) - set(OUTPUTS)) if os.path.isdir(args.output_dir) else []
    if others or (os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir)):
        what = ", ".join(others[:3]) or "not a directory"
        print(f"error: --output-dir {args.output_dir} holds other files ({what}): it is replaced as a whole; "
              "choose a new or tokenizer-only directory", file=sys.stderr)
        return 2
    final = lambda path: os.path.join(args.output_dir, os.path.basename(path))  # noqa: E731 (after the rename)
    try:  # written beside --output-dir, renamed into its place when complete (a crash leaves the old one)
        with tempfile.TemporaryDirectory(prefix="train-tokenizer-") as scratch, replace_output(args.output_dir) as tmp:
            files = text_files(args.input, args.json_keys, scratch)
            if args.type == "bpe":
                out = train_bpe(tmp, args.vocab_size, files=files, min_frequency=args.min_frequency)
            else:
                out = {"model": train_sentencepiece(os.path.join(tmp, "spm"), args.vocab_size, files=files,
                                                    model_type=args.sentencepiece_model_type)}
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = {key: final(path) for key, path in out.items()}
    if args.type == "bpe":
        print(f"wrote {out['vocab_file']}, {out['merge_file']}, {out['tokenizer_json']}")
        built = {"GPT2BPETokenizer": build_tokenizer("GPT2BPETokenizer", out["vocab_file"], out["merge_file"]),
                 "HuggingFaceTokenizer": build_tokenizer("HuggingFaceTokenizer", tokenizer_model=out["tokenizer_json"])}
    else:
        print(f"wrote {out['model']}")
        built = {"SentencePieceTokenizer": build_tokenizer("SentencePieceTokenizer", tokenizer_model=out["model"])}
    for name, tok in built.items():
        print(f"{name}: {tok.describe()}; model.vocab_size >= {tok.vocab_size} "
              f"(Megatron pads to a multiple of 128: {recommended_vocab_size(tok.vocab_size)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
