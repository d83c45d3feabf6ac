"""torchrun that exits 0 when a stop signal (SIGTERM, Ctrl-C) ended the run with a clean save; usage: ``--help``, back-end in megand/tools/."""

from megand.tools.launch import main

if __name__ == "__main__":
    main()
