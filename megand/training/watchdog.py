"""Hang watchdog: a rank that makes no progress for ``timeout_s`` prints where it is and exits.

The training loop reports progress (iteration and phase) at every phase of a step. A rank blocked in
a collective or p2p transfer whose peer is dead or stopped makes no progress: a background thread then
prints the iteration, the phase and the stacks of all the process's threads, and exits non-zero
without waiting for the collective, so the launcher (torchrun --max-restarts, SLURM) can restart the job.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

EXIT_HANG = 4  # the process exit code when the watchdog fires


class HangWatchdog:
    def __init__(self, timeout_s: float, rank: int):
        self.timeout_s, self.rank = timeout_s, rank
        self.iteration, self.phase = 0, "start"
        self.last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="megand-watchdog", daemon=True)
        self._thread.start()

    def progress(self, iteration: int, phase: str) -> None:
        self.iteration, self.phase, self.last = iteration, phase, time.monotonic()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(min(5.0, self.timeout_s / 4)):
            waited = time.monotonic() - self.last
            if waited > self.timeout_s:
                sys.stdout.flush()
                sys.stderr.write(
                    f"megand: rank {self.rank}: hang detected: no progress for {waited:.0f} s "
                    f"(train.collective_timeout_s={self.timeout_s:g}) in iteration {self.iteration}, phase "
                    f"'{self.phase}': another rank is dead or stuck; stacks of all threads of this rank follow, "
                    f"then exit {EXIT_HANG}\n")
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                os._exit(EXIT_HANG)
