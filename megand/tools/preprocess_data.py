"""Tokenize a JSON lines or Parquet corpus into Megatron-compatible indexed datasets (.bin/.idx), one per
json key (Parquet: column).

Example:
    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-model tok.model --append-eod --workers 8
    python tools/preprocess_data.py --input 'fineweb/*.parquet' --output-prefix data/fineweb \
        --tokenizer-model tokenizer.json --append-eod --workers 8
write data/corpus_text_document.bin and .idx (data/fineweb_text_document.*).
"""

import argparse
import sys


from megand.data.errors import DataError
from megand.data.preprocess import output_prefix_for, preprocess_jsonl
from megand.data.tokenizer import TOKENIZER_TYPES


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True,
                   help="a .jsonl, .jsonl.gz or .parquet file, or a directory or (quoted) glob of them")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--tokenizer-model", required=True,
                   help="sentencepiece .model, Hugging Face tokenizer.json or .tiktoken file")
    p.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                   help="the kind of --tokenizer-model (default: from its file name)")
    p.add_argument("--eod-id", type=int, default=None,
                   help="end-of-document id (default: the tokenizer's own, e.g. <|endoftext|> or </s>)")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="fields to tokenize (one dataset each)")
    p.add_argument("--append-eod", action="store_true", help="append the end-of-document id to every document")
    p.add_argument("--workers", type=int, default=1, help="tokenizer worker processes (in total)")
    p.add_argument("--partitions", type=int, default=1,
                   help="split the input into this many ranges processed concurrently, then merged")
    p.add_argument("--on-error", choices=["fail", "skip"], default="fail", help="what to do with malformed lines/rows")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    try:
        summary = preprocess_jsonl(args.input, args.output_prefix, args.tokenizer_model, args.json_keys,
                                   args.append_eod, args.workers, args.partitions, args.on_error,
                                   progress=not args.no_progress, tokenizer_type=args.tokenizer_type,
                                   eod_id=args.eod_id)
    except (DataError, OSError) as e:  # bad input or an unusable output path: one line, exit 2
        print(f"preprocess_data: {e}", file=sys.stderr)
        return 2
    print(summary.describe())
    for key in args.json_keys:
        print(f"wrote {output_prefix_for(args.output_prefix, key)}.bin/.idx")
    return 0

