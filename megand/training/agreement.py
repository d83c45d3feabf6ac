"""Errors every rank agrees on: a bad input found by one rank stops every rank with the same message.

A check that only some ranks can fail (rank 0 builds the dataset caches first; a directory that is
writable on one node only) would otherwise leave the other ranks waiting in a collective until a
timeout. ``on_every_rank`` runs the check, then all ranks exchange their outcome: if any rank failed,
every rank raises the failure of the lowest failing rank, marked ``every_rank`` so that the entry
script prints it once (from rank 0) instead of once per rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from megand.core.checkpointing.errors import CheckpointError
from megand.data.errors import DataError
from megand.training.config import ConfigError

# Errors that name a bad input: these are agreed on; anything else (a bug) propagates as it is.
USER_ERRORS = (ConfigError, DataError, CheckpointError, OSError)

T = TypeVar("T")


def raise_agreed(error: BaseException | None) -> None:
    """Collective: exchange this rank's error (or None); raise the first one any rank had, on every rank."""
    errors = [error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    failed = [e for e in errors if e is not None]
    if failed:
        agreed = failed[0]
        agreed.every_rank = True
        raise agreed


def on_every_rank(step: Callable[[], T]) -> T:
    """Run ``step`` on this rank and agree on its outcome with every other rank (collective)."""
    try:
        result = step()
    except USER_ERRORS as e:
        raise_agreed(e)
    raise_agreed(None)
    return result
