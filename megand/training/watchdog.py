"""Hang watchdog: a rank that makes no progress for ``timeout_s`` prints where it is and exits.

The training loop reports progress (iteration and phase) at every phase of a step. A checkpoint save or
load is a phase of its own kind: there this process's file writes count as progress too (a
long save on a slow filesystem keeps writing), and ``checkpoint.save_timeout_s`` bounds the whole phase,
so a long but healthy save is not taken for a hang while a rank waiting on a dead peer still is. A rank blocked in
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


def io_bytes() -> int | None:
    """Bytes this process has written through write system calls so far (Linux; sockets' send calls,
    which collectives use, are not counted); None elsewhere."""
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(": ", 1) for line in f.read().splitlines() if ": " in line)
        return int(fields["wchar"])
    except (OSError, KeyError, ValueError):
        return None


class HangWatchdog:
    def __init__(self, timeout_s: float, rank: int, on_hang=None):
        """``on_hang(message, iteration, phase)``: called before the exit (the hang report); its failure is
        printed and the exit goes on."""
        self.timeout_s, self.rank, self.on_hang = timeout_s, rank, on_hang
        self.progress(0, "start")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="megand-watchdog", daemon=True)
        self._thread.start()

    def progress(self, iteration: int, phase: str, io_budget_s: float | None = None,
                 io_budget_key: str = "checkpoint.save_timeout_s") -> None:
        """Entering ``phase`` of ``iteration``. ``io_budget_s``: a phase of file I/O (a checkpoint save),
        where the process's own file writes count as progress, for at most ``io_budget_s`` in all
        (named ``io_budget_key`` in the message)."""
        # one assignment: the watching thread never sees a new phase with an old start time
        self.current = (time.monotonic(), io_budget_s, io_budget_key, iteration, phase, [io_bytes(), None])

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
            started, budget_s, key, iteration, phase, io = self.current
            now, last = time.monotonic(), started
            if budget_s is not None:
                seen = io_bytes()
                if seen is not None and seen != io[0]:
                    io[0], io[1] = seen, now
                last = max(started, io[1] or started)
            if budget_s is not None and now - started > budget_s:
                head = f"megand: rank {self.rank}: hang detected: no end for {now - started:.0f} s ({key}={budget_s:g})"
            elif now - last > self.timeout_s:
                head = (f"megand: rank {self.rank}: hang detected: no progress for {now - last:.0f} s "
                        f"(train.collective_timeout_s={self.timeout_s:g})")
            else:
                continue
            sys.stdout.flush()
            sys.stderr.write(
                f"{head} in iteration {iteration}, phase "
                f"'{phase}': another rank is dead or stuck; stacks of all threads of this rank follow, "
                f"then exit {EXIT_HANG}\n")
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
            if self.on_hang is not None:
                try:
                    self.on_hang(head, iteration, phase)
                except Exception as e:  # noqa: BLE001 - the exit must come whatever the report does
                    sys.stderr.write(f"megand: rank {self.rank}: the hang report failed: {type(e).__name__}: {e}\n")
                sys.stderr.flush()
            os._exit(EXIT_HANG)
