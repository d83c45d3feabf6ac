"""Tokenize a corpus (JSON lines or Parquet) into Megatron-compatible indexed datasets (.bin/.idx), one per json key; usage: ``--help``, back-end in megand/tools/."""

import sys

from megand.tools.preprocess_data import main

if __name__ == "__main__":
    sys.exit(main())
