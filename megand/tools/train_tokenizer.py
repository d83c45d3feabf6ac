"""Train a sentencepiece tokenizer (BPE or unigram) from jsonl or plain-text files.

Example:
    python tools/train_tokenizer.py --input corpus.jsonl --json-keys text --model-prefix tok \
        --vocab-size 32000 --model-type bpe --byte-fallback
writes tok.model and tok.vocab. Files ending in .jsonl/.json are read as JSON lines (field --json-keys),
anything else as text with one training line per line.
"""

import argparse
import os
import sys

from tqdm import tqdm


from megand.data.errors import DataError
from megand.data.jsonl import iter_texts
from megand.data.spm_train import train_sentencepiece


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="jsonl or text files")
    p.add_argument("--json-keys", default="text", help="field holding the text in jsonl input")
    p.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    p.add_argument("--character-coverage", type=float, default=0.9995)
    p.add_argument("--byte-fallback", action="store_true", help="unknown characters become byte pieces")
    p.add_argument("--normalization", default="nmt_nfkc",
                   help="sentencepiece normalization rule; 'identity' keeps whitespace as is (code)")
    p.add_argument("--input-sentence-size", type=int, default=0,
                   help="train on a random sample of this many lines (0: all)")
    p.add_argument("--num-threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--on-error", choices=["fail", "skip"], default="fail", help="malformed jsonl lines")
    args = p.parse_args(argv)
    texts = tqdm(iter_texts(args.input, args.json_keys, args.on_error), desc="documents read", unit=" docs")
    try:
        path = train_sentencepiece(texts, args.model_prefix, args.vocab_size, args.model_type,
                                   args.character_coverage, args.byte_fallback, args.input_sentence_size,
                                   args.num_threads, args.normalization)
    except (DataError, RuntimeError) as e:  # RuntimeError: sentencepiece rejects the options/corpus
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0

