"""Benchmark a training config for a fixed number of steps after warm-up; print one JSON line; usage: ``--help``, back-end in megand/tools/."""

from megand.tools.benchmark import main

if __name__ == "__main__":
    main()
