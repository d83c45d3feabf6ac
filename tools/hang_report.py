"""Summarise the hang reports of a run (which ranks the others wait for, in which collective); usage: ``--help``, back-end in megand/tools/."""

import sys

from megand.tools.hang_report import main

if __name__ == "__main__":
    sys.exit(main())
