"""A line on stderr every few seconds while a long step runs, so no wait over a few seconds is silent.

tqdm bars show progress on a terminal only (``disable=None``); in a log or a pipe a bar would be one
line per update or nothing at all, so the tools wrap each long step in ``heartbeat``, which prints
``what: 12 s so far`` (and the step's own status when it has one) every ``interval`` seconds, then a
closing ``what: done in 31 s`` when the step took longer than one interval.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable

INTERVAL_S = 5.0


@contextlib.contextmanager
def heartbeat(what: str, status: Callable[[], str] | None = None, interval: float = INTERVAL_S, file=None):
    out = file or sys.stderr
    stop, t0 = threading.Event(), time.monotonic()

    def beat():
        while not stop.wait(interval):
            extra = ""
            if status is not None:
                try:
                    extra = f" ({status()})"
                except Exception:  # a status is a courtesy: never let it break the step
                    extra = ""
            print(f"{what}: {time.monotonic() - t0:.0f} s so far{extra}", file=out, flush=True)

    thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        seconds = time.monotonic() - t0
        if seconds >= interval:
            print(f"{what}: done in {seconds:.0f} s", file=out, flush=True)
