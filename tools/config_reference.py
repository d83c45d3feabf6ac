"""Print the configuration reference (markdown) from the structured schema in megand/training/config.py; usage: ``--help``, back-end in megand/tools/."""

from megand.tools.config_reference import main

if __name__ == "__main__":
    main()
