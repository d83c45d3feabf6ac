"""The one exception type the data pipeline raises for bad inputs (files, config values, corpus lines)."""


class DataError(ValueError):
    """A data input is unusable; the message names the file, line or config value at fault."""
