"""Convert between megand checkpoints (any parallel layout) and Hugging Face ``transformers`` directories; usage: ``--help``, back-end in megand/tools/."""

import sys

from megand.tools.convert_checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
