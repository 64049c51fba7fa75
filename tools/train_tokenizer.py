"""Train a tokenizer on local text files.

    python tools/train_tokenizer.py --type bpe --input a.txt b.txt --vocab-size 8000 --output-dir tok/
        -> tok/vocab.json + tok/merges.txt (--tokenizer-type GPT2BPETokenizer) and
           tok/tokenizer.json (--tokenizer-type HuggingFaceTokenizer)
    python tools/train_tokenizer.py --type sentencepiece --input a.txt --vocab-size 8000 --output-dir tok/
        -> tok/spm.model (--tokenizer-type SentencePieceTokenizer)
"""
import argparse
import os
import sys

from megatron_moe.data.tokenizer_training import train_bpe, train_sentencepiece


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--type", choices=["bpe", "sentencepiece"], default="bpe")
    p.add_argument("--input", nargs="+", required=True, help="local text files")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--min-frequency", type=int, default=2, help="bpe: least count of a merged pair")
    p.add_argument("--sentencepiece-model-type", choices=["bpe", "unigram"], default="bpe")
    args = p.parse_args(argv)
    for f in args.input:
        if not os.path.isfile(f):
            print(f"error: {f}: input file not found", file=sys.stderr)
            return 1
    try:
        if args.type == "bpe":
            files = train_bpe(args.output_dir, args.vocab_size, files=args.input, min_frequency=args.min_frequency)
            print(f"wrote {files['vocab_file']}, {files['merge_file']}, {files['tokenizer_json']}")
        else:
            model = train_sentencepiece(os.path.join(args.output_dir, "spm"), args.vocab_size, files=args.input,
                                        model_type=args.sentencepiece_model_type)
            print(f"wrote {model}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
