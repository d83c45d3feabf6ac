"""Rehearse one rank of any layout on one CPU: per-phase peak bytes against the memory estimator; usage: ``--help``, back-end in megand/tools/."""

from megand.tools.rehearse import main

if __name__ == "__main__":
    main()
