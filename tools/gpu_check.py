"""GPU readiness check: tests, throughput next to transformers, CUDA-only paths; one JSON report and a table; usage: ``--help``, back-end in megand/tools/."""

import sys

from megand.tools.gpu_check import main

if __name__ == "__main__":
    sys.exit(1 if any(r["status"] == "failed" for r in main()) else 0)
