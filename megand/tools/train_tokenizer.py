"""Train a sentencepiece tokenizer (BPE or unigram) from JSON lines, Parquet or plain-text files.

Example:
    python tools/train_tokenizer.py --input corpus.jsonl --json-keys text --model-prefix tok \
        --vocab-size 32000 --model-type bpe
writes tok.model and tok.vocab. Files ending in .jsonl/.json/.jsonl.gz are read as JSON lines (field
--json-keys), Parquet files (recognised by their content) by column --json-keys, anything else as UTF-8
text with one training line per line; a binary file or a corpus with no text is refused.

The defaults keep the text exactly (decode(encode(text)) == text, code included): no normalisation
(--normalization identity: newlines, indentation and runs of spaces are kept) and byte fallback
(characters outside the vocabulary become their UTF-8 bytes, never an unknown piece).
--normalization nmt_nfkc --no-byte-fallback gives sentencepiece's own lossy defaults.
"""

import argparse
import os
import sys

from tqdm import tqdm


from megand.data.errors import DataError
from megand.data.jsonl import file_kind, iter_texts
from megand.data.spm_train import train_sentencepiece
from megand.data.tokenizer import SentencePieceTokenizer
from megand.tools.progress import heartbeat


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="jsonl or text files")
    p.add_argument("--json-keys", "--text-key", dest="json_keys", default="text",
                   help="field (JSON lines) or column (Parquet) holding the text")
    p.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    p.add_argument("--character-coverage", type=float, default=0.9995)
    p.add_argument("--byte-fallback", action=argparse.BooleanOptionalAction, default=True,
                   help="characters outside the vocabulary become byte pieces (default: on; off: they become <unk>)")
    p.add_argument("--normalization", default="identity",
                   help="sentencepiece normalization rule (default identity: the text as it is, whitespace "
                        "included; nmt_nfkc folds whitespace runs into one space)")
    p.add_argument("--input-sentence-size", type=int, default=0,
                   help="train on a random sample of this many lines (0: all)")
    p.add_argument("--num-threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--on-error", choices=["fail", "skip"], default="fail", help="malformed jsonl lines")
    args = p.parse_args(argv)
    inputs = ", ".join(args.input)
    missing = [path for path in args.input if not os.path.isfile(path)]
    if missing:
        print(f"train_tokenizer: --input {', '.join(missing)}: no such file", file=sys.stderr)
        return 2
    try:
        for path in args.input:  # refuse binary input before reading anything
            file_kind(path)
    except DataError as e:
        print(f"train_tokenizer: {e}", file=sys.stderr)
        return 2
    counted = [0]

    def count(documents):
        for counted[0], document in enumerate(documents, 1):
            yield document

    texts = tqdm(count(iter_texts(args.input, args.json_keys, args.on_error)), desc="documents read", unit=" docs",
                 disable=None)  # a bar on a terminal only; the heartbeat gives logs a line every few seconds
    try:
        with heartbeat("train_tokenizer: reading and training", lambda: f"{counted[0]} documents read"):
            path = train_sentencepiece(texts, args.model_prefix, args.vocab_size, args.model_type,
                                       args.character_coverage, args.byte_fallback, args.input_sentence_size,
                                       args.num_threads, args.normalization)
    except DataError as e:
        print(f"train_tokenizer: --input {inputs}: {e}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError) as e:  # RuntimeError: sentencepiece rejects the options/corpus
        print("train_tokenizer: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    print(vocabulary_report(path, args.vocab_size, counted[0]))
    return 0


def vocabulary_report(path: str, asked: int, documents: int) -> str:
    """What was written, and why the vocabulary is smaller than asked when it is."""
    got = SentencePieceTokenizer(path).vocab_size
    if got >= asked:
        return f"wrote {path}: {got} pieces"
    return (f"wrote {path}: {got} pieces, fewer than the {asked} asked for: the corpus ({documents} documents) "
            f"yields no more distinct pieces (sentencepiece stops there rather than fail); train on more text "
            f"for a larger vocabulary. model.vocab_size must be >= {got}")
