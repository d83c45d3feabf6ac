"""The registered pipeline schedules (``parallel.pp_schedule``), by name: the one lookup every reader
uses (records: record.py; the schedules: orders/)."""

from __future__ import annotations

from typing import Optional

from megand.core.pipeline_parallel.orders import SCHEDULES
from megand.core.pipeline_parallel.record import PipelineSchedule

DEFAULT_SCHEDULE = SCHEDULES[0].name  # parallel.pp_schedule's default (1f1b)

_REGISTRY: dict = {record.name: record for record in SCHEDULES}


def register(record: PipelineSchedule) -> None:
    """Make ``record`` a choice of ``parallel.pp_schedule`` (a name taken already is an error)."""
    if record.name in _REGISTRY:
        raise ValueError(f"pipeline schedule {record.name!r} is registered already")
    _REGISTRY[record.name] = record


def unregister(name: str) -> None:
    """Withdraw a schedule :func:`register` added."""
    del _REGISTRY[name]


def schedule_names() -> tuple:
    """Every registered schedule's name, in registration order."""
    return tuple(_REGISTRY)


def schedule_record(name: str) -> PipelineSchedule:
    """The record of ``parallel.pp_schedule=name``; an unknown name is a ValueError listing the choices."""
    record = _REGISTRY.get(name)
    if record is None:
        raise ValueError(f"parallel.pp_schedule={name!r}: choose one of {', '.join(_REGISTRY)}")
    return record


def schedule_error(name: str, pp: int, vpp: Optional[int], m: int, counted: Optional[str] = None) -> Optional[str]:
    """Why ``parallel.pp_schedule=name`` cannot run ``pp`` ranks of ``vpp`` chunks on ``m`` micro-batches
    per step (``counted``: how they were counted, for the message), or None."""
    try:
        record = schedule_record(name)
    except ValueError as e:
        return str(e)
    return record.error(pp, vpp, m, counted)
