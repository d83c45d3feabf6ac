"""Compare two megand checkpoints (any layouts, any sharding levels) tensor by tensor, worst first; usage: ``--help``, back-end in megand/tools/."""

import sys

from megand.tools.compare_checkpoints import main

if __name__ == "__main__":
    sys.exit(main())
