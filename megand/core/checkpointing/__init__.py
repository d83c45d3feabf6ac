"""Sharded, layout-free checkpoints on torch.distributed.checkpoint: atomic and asynchronous saves,
resume and resharding, stop-on-signal, and one-process access to full weights for tools."""

from megand.core.checkpointing.checkpointer import Checkpointer, LoadedState
from megand.core.checkpointing.files import CheckpointError, resolve
from megand.core.checkpointing.signals import StopOnSignal
