"""Sharded, layout-free checkpoints on torch.distributed.checkpoint: atomic and asynchronous saves,
resume and resharding, stop-on-signal, and one-process access to full weights for tools."""

from megand.core.checkpointing.config import CheckpointConfig
from megand.core.checkpointing.errors import CheckpointError, CheckpointWriteError
from megand.core.checkpointing.signals import StopOnSignal


def __getattr__(name):
    # torch.distributed.checkpoint takes ~1.5 s to import on every rank: only runs that use
    # checkpoints pay for it.
    if name in ("Checkpointer", "LoadedState"):
        from megand.core.checkpointing import checkpointer

        return getattr(checkpointer, name)
    if name == "resolve":
        from megand.core.checkpointing.files import resolve

        return resolve
    raise AttributeError(name)
