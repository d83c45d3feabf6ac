"""Hang watchdog: a rank that makes no progress for ``timeout_s`` prints where it is and exits.

The training loop reports progress (iteration and phase) at every phase of a step; a phase may carry a
budget of its own (a checkpoint save: ``checkpoint.save_timeout_s``), so a long but healthy save is not
taken for a hang. A rank blocked in
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
        self.progress(0, "start")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="megand-watchdog", daemon=True)
        self._thread.start()

    def progress(self, iteration: int, phase: str, timeout_s: float | None = None,
                 timeout_key: str = "train.collective_timeout_s") -> None:
        """Entering ``phase`` of ``iteration``; ``timeout_s`` (named ``timeout_key`` in the message)
        replaces the default timeout until the next phase."""
        if timeout_s is None:
            timeout_s, timeout_key = self.timeout_s, "train.collective_timeout_s"
        # one assignment: the watching thread never sees a new budget with an old start time
        self.current = (time.monotonic(), timeout_s, timeout_key, iteration, phase)

    @property
    def iteration(self) -> int:
        return self.current[3]

    @property
    def phase(self) -> str:
        return self.current[4]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(min(5.0, self.timeout_s / 4)):
            last, timeout_s, key, iteration, phase = self.current
            waited = time.monotonic() - last
            if waited > timeout_s:
                if key == "train.collective_timeout_s":
                    head = (f"megand: rank {self.rank}: hang detected: no progress for {waited:.0f} s "
                            f"(train.collective_timeout_s={timeout_s:g})")
                else:  # a phase with a budget of its own (a checkpoint save)
                    head = f"megand: rank {self.rank}: hang detected: no progress for {waited:.0f} s ({key}={timeout_s:g})"
                sys.stdout.flush()
                sys.stderr.write(
                    f"{head} in iteration {iteration}, phase "
                    f"'{phase}': another rank is dead or stuck; stacks of all threads of this rank follow, "
                    f"then exit {EXIT_HANG}\n")
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                os._exit(EXIT_HANG)
