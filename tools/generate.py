"""Generate text from a megand checkpoint (any layout), in one process; usage: ``--help``, back-end in megand/tools/."""

import sys

from megand.tools.generate import main

if __name__ == "__main__":
    sys.exit(main())
