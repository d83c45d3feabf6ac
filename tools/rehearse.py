"""Rehearse one rank of any layout on one CPU: per-phase peak bytes against the memory estimator.

    python tools/rehearse.py +experiment=llama70b_64gpu --world-size 64 --rank 0

See megand/tools/rehearse.py for what each phase covers.
"""

from megand.tools.rehearse import main

if __name__ == "__main__":
    main()
