"""SIGTERM/SIGINT: finish the current step, save a checkpoint, exit 0.

A signal may reach only some ranks (a scheduler preempting one node, a test signalling one process).
Each step every rank contributes its flag to an all-reduce (MAX), so all ranks stop at the same step: the
training loop adds :meth:`StopOnSignal.flag` to the all-reduce its step already makes (no collective of
its own per step); :meth:`StopOnSignal.agreed` is that all-reduce alone, for loops without one.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist


class StopOnSignal:
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: int | None = None
        self.group = dist.new_group(backend="gloo")  # CPU flag; never touches the training streams
        self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def _handle(self, signum, frame):
        self.received = signum

    SIGNAL, LIMIT = 2, 1  # why the run stops (a signal wins when both)

    def flag(self, limit_reached: bool = False) -> int:
        """This rank's vote: ``SIGNAL`` if it received a stop signal, else ``LIMIT`` if ``limit_reached``,
        else 0; the largest vote over the ranks is the run's decision."""
        return self.SIGNAL if self.received is not None else self.LIMIT if limit_reached else 0

    def agreed(self, limit_reached: bool = False) -> int:
        """Collective: ``SIGNAL`` if any rank has received a stop signal, else ``LIMIT`` if any rank
        passed ``limit_reached=True`` (e.g. its clock is past a time limit), else 0."""
        flag = torch.tensor([self.flag(limit_reached)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag.item())

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
