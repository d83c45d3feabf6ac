"""Long waits are never silent: a heartbeat line every interval while a step runs, and a closing line."""

import io
import time

from megand.tools.progress import heartbeat


def test_heartbeat_prints_while_waiting():
    out, seen = io.StringIO(), iter(range(100))
    with heartbeat("plan: searching layouts", lambda: f"{next(seen)} layouts", interval=0.05, file=out):
        time.sleep(0.3)
    lines = out.getvalue().splitlines()
    assert len(lines) >= 3 and lines[0].startswith("plan: searching layouts: 0 s so far (0 layouts)")
    assert lines[-1].startswith("plan: searching layouts: done in ")


def test_short_steps_stay_quiet():
    out = io.StringIO()
    with heartbeat("quick", interval=5.0, file=out):
        pass
    assert out.getvalue() == ""
