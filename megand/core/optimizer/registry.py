"""The registered optimizers (``optim.name``): each one a record (record.py) in a file of its own."""

from __future__ import annotations

from megand.core.optimizer.adamw import ADAMW
from megand.core.optimizer.checks import check_common, check_schedule
from megand.core.optimizer.lion import LION
from megand.core.optimizer.muon import MUON
from megand.core.optimizer.record import OptimizerRecord

OPTIMIZERS: dict[str, OptimizerRecord] = {r.name: r for r in (ADAMW, MUON, LION)}


def record(name: str) -> OptimizerRecord:
    if name not in OPTIMIZERS:
        raise ValueError(f"optim.name={name!r}: expected one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name]


def optimizer_for(name: str, role: str) -> OptimizerRecord:
    """The record that updates a parameter of ``role`` under ``optim.name=name``: the named optimizer if it
    takes the role, else its fallback's (and so on)."""
    rec = record(name)
    while role not in rec.roles:
        if rec.fallback is None:
            raise ValueError(f"optim.name={name}: no optimizer takes parameters of role {role!r}")
        rec = record(rec.fallback)
    return rec


def chain(name: str) -> list[OptimizerRecord]:
    """The named optimizer and its fallbacks, in order."""
    recs = [record(name)]
    while recs[-1].fallback is not None:
        recs.append(record(recs[-1].fallback))
    return recs


def check_values(o, decay_iters: int, iters: int) -> None:
    """Every optimizer and schedule value of ``optim.*`` (``o``) in range; ValueError naming the first that
    is not. ``decay_iters``: the end of the decay (``optim.decay_iters``, null: ``train.iters``); ``iters``:
    the run's steps."""
    check_common(o)
    check_schedule(o, decay_iters, iters)
    for rec in chain(o.name):
        if rec.check is not None:
            rec.check(o)


def state_names() -> frozenset[str]:
    """Every state name any registered optimizer keeps (checkpoint keys ``optim.<param>.<state name>``)."""
    return frozenset(s for r in OPTIMIZERS.values() for s in r.state)
