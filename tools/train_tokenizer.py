"""Train a sentencepiece tokenizer (BPE or unigram) from jsonl or plain-text files; usage: ``--help``, back-end in megand/tools/."""

import sys

from megand.tools.train_tokenizer import main

if __name__ == "__main__":
    sys.exit(main())
