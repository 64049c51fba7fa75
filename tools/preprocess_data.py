"""Tokenize a corpus into Megatron-LM indexed datasets (same flags and output names as Megatron-LM's
tools/preprocess_data.py).

    python tools/preprocess_data.py --input docs.jsonl --json-keys text --output-prefix out \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 2
        -> out_text_document.bin / out_text_document.idx (identical for any --workers)

--input: JSON lines (read natively), or json / parquet / txt / csv / arrow through Hugging Face
`datasets` (local files, offline; txt is one document per line under the key `text`).
"""
import argparse
import sys

from megatron_moe.data.preprocess import EncodeOptions, preprocess
from megatron_moe.data.tokenizers import TOKENIZERS, TokenizerSpec


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="jsonl (or json/parquet/txt/csv/arrow) file")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract, one output each")
    g.add_argument("--split-sentences", action="store_true", help="one sequence per sentence (BERT)")
    g.add_argument("--keep-newlines", action="store_true", help="keep newlines between sentences")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZERS.names())
    g.add_argument("--tokenizer-model", help="SentencePiece .model, or tokenizer.json / its directory")
    g.add_argument("--vocab-file", help="vocab.json (GPT2BPETokenizer) or vocab.txt (BertWordPiece*)")
    g.add_argument("--merge-file", help="merges.txt (GPT2BPETokenizer)")
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document token")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True)
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="processes tokenizing in parallel")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    opts = EncodeOptions(
        json_keys=tuple(args.json_keys),
        tokenizer=TokenizerSpec(args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_model),
        append_eod=args.append_eod, split_sentences=args.split_sentences, keep_newlines=args.keep_newlines)
    try:
        outputs = preprocess(args.input, args.output_prefix, opts, args.workers, progress=not args.no_progress)
    except ValueError as e:  # includes ConfigError; always one line
        print(f"error: {e}", file=sys.stderr)
        return 1
    for prefix in outputs.values():
        print(f"wrote {prefix}.bin and {prefix}.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
