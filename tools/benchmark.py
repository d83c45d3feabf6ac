"""Benchmark a training config for a fixed number of steps after warm-up; print one JSON line; usage: ``--help``, back-end in megand/tools/."""

import megand

megand.prefer_huge_pages()  # as pretrain_gpt.py, before anything imports torch

from megand.tools.benchmark import main  # noqa: E402

if __name__ == "__main__":
    main()
