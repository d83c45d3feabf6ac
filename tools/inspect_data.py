"""Show what a run will train on (see megand/tools/inspect_data.py)."""

import sys

from megand.tools.inspect_data import main

if __name__ == "__main__":
    sys.exit(main())
