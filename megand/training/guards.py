"""Guards of a long run: non-finite steps and loss spikes.

Both decide from values every rank holds identically (the loss agreed over the world, the optimizer's
all-reduced non-finite flag), so every rank takes the same decision without another collective.
"""

from __future__ import annotations

import math
from collections import deque

import torch
import torch.distributed as dist

EXIT_NON_FINITE = 3  # the process exit code when the run stops on non-finite steps


class NonFiniteStop(RuntimeError):
    """Too many consecutive steps skipped for a non-finite loss or gradient; no checkpoint was written."""


def first_nonfinite_grad(optimizer) -> str | None:
    """The name of the first parameter whose (local share of the) gradient is not finite, on this rank.
    Called only after a skipped step: it reads this rank's gradient shard once."""
    for piece in optimizer.pieces:
        if not bool(torch.isfinite(piece.grad).all()):
            return piece.name
    return None


# elements per isfinite mask (1 << 18 made a ZeRO-3 save at dp=4 of a 3M-parameter model peak +1.8 MiB,
# above a tenth of its 13 MiB of state; a shard of 1e9 elements is ~15k chunks)
FINITE_CHECK_CHUNK = 1 << 16


def all_finite(tensors, device) -> bool:
    """Collective: whether every tensor on every rank is finite (each rank reads only its own shards)."""
    # in chunks: isfinite's temporaries (a copy of its input, a mask) then cost a chunk, not the largest tensor
    # (one flag per chunk, read once)
    flags = [torch.isfinite(chunk).all() for t in tensors if t is not None and t.is_floating_point()
             for chunk in t.detach().reshape(-1).split(FINITE_CHECK_CHUNK)]
    ok = bool(torch.stack(flags).all()) if flags else True
    flag = torch.tensor([0.0 if ok else 1.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0.0


class SkipGuard:
    """Counts consecutive skipped steps; remembers where the current streak began."""

    def __init__(self, max_skipped: int):
        self.max_skipped = max_skipped
        self.streak = 0
        self.total = 0
        self.first: dict | None = None  # iteration, reason, rank, parameter of the streak's first skip

    def record(self, iteration: int, skipped: bool, counts: bool, where=None) -> None:
        """``counts``: the skip counts towards the stop (fp16 overflows count only once the loss scale can
        back off no further); ``where``: a callable giving ``(reason, rank, parameter)``, called on the
        first skip of a streak only."""
        if not skipped:
            self.streak, self.first = 0, None
            return
        self.total += 1
        if not counts:
            return
        self.streak += 1
        if self.first is None:
            reason, rank, parameter = where() if where else ("non-finite", None, None)
            self.first = {"iteration": iteration, "reason": reason, "rank": rank, "parameter": parameter}

    @property
    def exhausted(self) -> bool:
        return self.streak >= self.max_skipped

    def message(self) -> str:
        f = self.first or {}
        where = ""
        if f.get("parameter"):
            where = f" (first non-finite gradient: parameter {f['parameter']} on rank {f['rank']})"
        return (f"{self.streak} consecutive steps skipped (train.max_skipped_steps={self.max_skipped}): the first "
                f"bad iteration was {f.get('iteration')}, {f.get('reason')}{where}; no checkpoint was written from "
                f"this state, `latest` still names the last good one")


class SpikeDetector:
    """A loss above ``factor`` x the median of the last ``window`` accepted losses is a spike (the guard
    starts once the window is full). Spikes and non-finite losses do not enter the window."""

    def __init__(self, factor: float, window: int):
        self.factor = factor
        self.recent: deque[float] = deque(maxlen=window)

    def median(self) -> float | None:
        if len(self.recent) < self.recent.maxlen:
            return None
        values = sorted(self.recent)
        mid = len(values) // 2
        return values[mid] if len(values) % 2 else 0.5 * (values[mid - 1] + values[mid])

    def is_spike(self, loss: float) -> bool:
        median = self.median()
        return median is not None and math.isfinite(loss) and loss > self.factor * median

    def accept(self, loss: float) -> None:
        if math.isfinite(loss):
            self.recent.append(loss)
