"""Plan the fastest layouts of a run on a cluster (homogeneous or heterogeneous); usage: ``--help``, back-end in megand/tools/."""

import sys

from megand.tools.plan import main

if __name__ == "__main__":
    sys.exit(main())
