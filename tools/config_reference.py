"""Print the configuration reference (markdown) from the structured schema in megand/training/config.py.

The README's "Configuration reference" section is this output; a test keeps the two equal.
"""

from megand.tools.config_reference import main

if __name__ == "__main__":
    main()
