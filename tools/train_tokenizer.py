"""Train a sentencepiece tokenizer (BPE or unigram) from jsonl or plain-text files.

Example:
    python tools/train_tokenizer.py --input corpus.jsonl --json-keys text --model-prefix tok \
        --vocab-size 32000 --model-type bpe --byte-fallback
writes tok.model and tok.vocab. Files ending in .jsonl/.json are read as JSON lines (field --json-keys),
anything else as text with one training line per line.
"""

import sys

from megand.tools.train_tokenizer import main

if __name__ == "__main__":
    sys.exit(main())
