"""Measure this machine's GEMM rates, memory bandwidth, collectives and framework overheads into a planner profile; usage: ``--help``, back-end in megand/tools/."""

import sys

from megand.tools.calibrate import main

if __name__ == "__main__":
    sys.exit(main())
