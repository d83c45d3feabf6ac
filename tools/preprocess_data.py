"""Tokenize a jsonl corpus into Megatron-compatible indexed datasets (.bin/.idx), one per json key.

Example:
    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-model tok.model --append-eod --workers 8
writes data/corpus_text_document.bin and .idx.
"""

import sys

from megand.tools.preprocess_data import main

if __name__ == "__main__":
    sys.exit(main())
