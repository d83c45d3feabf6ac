"""The checkpoint error, in a module of its own so catching it does not import DCP."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this run; the message names the file or tensor."""
