"""Estimate per-rank memory (parameters, optimizer states, activations) for a run's config and layout; usage: ``--help``, back-end in megand/tools/."""

import sys

from megand.tools.estimate import main

if __name__ == "__main__":
    sys.exit(main())
