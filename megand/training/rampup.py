"""Batch-size ramp-up (``train.rampup_batch_size=[start, increment, ramp_samples]``), Megatron's rule.

The global batch grows from ``start`` to ``train.global_batch_size`` (``final``) in ``n = (final - start) /
increment`` equal steps of ``increment``, one every ``ramp_samples / n`` consumed samples; past
``ramp_samples`` it is ``final``. As a function of the samples consumed before the step, ``c``::

    batch(c) = final                                        if c > ramp_samples
             = start + increment * floor(c * n / ramp_samples)   otherwise

(integer arithmetic: ``floor(c / (ramp_samples / n))`` without rounding). The micro-batch count of a step
is ``batch(c) / (micro_batch_size x dp)``. Since the batch depends only on the samples consumed (saved in
every checkpoint), a run resumed anywhere in the ramp, at any layout, continues it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchRamp:
    start: int
    increment: int
    ramp_samples: int
    final: int

    @property
    def increments(self) -> int:
        return (self.final - self.start) // self.increment

    def batch_size(self, consumed: int) -> int:
        """The global batch size of the step that starts after ``consumed`` samples."""
        if consumed > self.ramp_samples or self.increments == 0:
            return self.final
        return self.start + self.increment * (consumed * self.increments // self.ramp_samples)

    def sizes(self) -> list[int]:
        """Every global batch size of the run, in order."""
        return list(range(self.start, self.final + 1, self.increment))


class ConstantBatch:
    """No ramp-up: every step takes ``final`` samples."""

    def __init__(self, final: int):
        self.final = final

    def batch_size(self, consumed: int) -> int:
        return self.final

    def sizes(self) -> list[int]:
        return [self.final]


def batch_ramp(train) -> BatchRamp | ConstantBatch:
    """The run's batch sizes from ``train`` (``rampup_batch_size`` null: constant)."""
    if train.get("rampup_batch_size") is None:
        return ConstantBatch(int(train.global_batch_size))
    start, increment, samples = (int(v) for v in train.rampup_batch_size)
    return BatchRamp(start, increment, samples, int(train.global_batch_size))


def ramp_error(train, micro_times_dp: int, rule) -> str | None:
    """What is wrong with ``train.rampup_batch_size`` for this layout (a message naming the values), or None.
    ``rule``: the pipeline schedule's micro-batch rule (megand/core/pipeline_parallel/record.py), which every
    batch size of the ramp must meet, not only the final one."""
    ramp = train.get("rampup_batch_size")
    if ramp is None:
        return None
    if len(ramp) != 3 or not all(isinstance(v, int) for v in ramp):
        return f"train.rampup_batch_size={list(ramp)} must be three integers [start, increment, ramp_samples]"
    start, increment, samples = ramp
    final = train.global_batch_size
    if start < 1 or increment < 1 or samples < 1:
        return f"train.rampup_batch_size={list(ramp)}: start, increment and ramp_samples must be positive"
    if start > final or (final - start) % increment:
        return (f"train.rampup_batch_size={list(ramp)}: train.global_batch_size={final} minus start {start} must be "
                f"a non-negative multiple of the increment {increment}")
    for size in range(start, final + 1, increment):
        if size % micro_times_dp:
            return (f"train.rampup_batch_size={list(ramp)} reaches a global batch of {size}, not divisible by "
                    f"train.micro_batch_size x dp = {micro_times_dp}")
        message = rule.ramp_error(size // micro_times_dp, size, list(ramp))
        if message:
            return message
    return None
