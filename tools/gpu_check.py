"""GPU readiness check: tests, throughput next to transformers, CUDA-only paths; one JSON report and a table.

    python tools/gpu_check.py [--out gpu_check.json] [--sizes full|tiny] [--only NAME ...]

Exit code 1 when a check failed. See megand/tools/gpu_check.py.
"""

import sys

from megand.tools.gpu_check import main

if __name__ == "__main__":
    sys.exit(1 if any(r["status"] == "failed" for r in main()) else 0)
