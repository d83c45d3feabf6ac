"""Timers of device work, chosen once by device: what the busy, compute and communication figures measure.

On the CPU the work is done when the call that does it returns: wall time on the host
(``time.perf_counter``) is the work's time. On CUDA a call only queues kernels and returns; host time
would measure the launches. There a timer records a CUDA event on the current stream at the start and
at the end of each interval and sums the device time between them; the events are read (one
synchronisation with the last one) only when the total is asked for, e.g. at a log line.
"""

from __future__ import annotations

import time

import torch


class HostTimer:
    """Wall time on the host (the CPU: the work is finished when its call returns)."""

    def __init__(self):
        self._total, self._start = 0.0, None

    def start(self) -> None:
        self._start = time.perf_counter()

    def stop(self) -> None:
        self._total += time.perf_counter() - self._start
        self._start = None

    @property
    def seconds(self) -> float:
        """The total of the intervals so far."""
        return self._total

    def reset(self) -> None:
        self._total = 0.0


class CudaEventTimer:
    """Device time on the current CUDA stream between each ``start`` and ``stop``."""

    def __init__(self):
        self._pairs: list[tuple] = []
        self._start = None
        self._read = 0.0  # intervals already read

    def start(self) -> None:
        self._start = torch.cuda.Event(enable_timing=True)
        self._start.record()

    def stop(self) -> None:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pairs.append((self._start, end))
        self._start = None

    @property
    def seconds(self) -> float:
        """The total of the intervals so far: waits for the last interval's work to finish."""
        if self._pairs:
            self._pairs[-1][1].synchronize()
            self._read += sum(start.elapsed_time(end) for start, end in self._pairs) / 1e3  # ms
            self._pairs = []
        return self._read

    def reset(self) -> None:
        self._pairs, self._read = [], 0.0


def device_timer(device: torch.device):
    """The timer that measures work on ``device``: CUDA events on CUDA, host wall time elsewhere."""
    return CudaEventTimer() if device.type == "cuda" else HostTimer()
