"""``torchrun`` that exits 0 when a stop signal ended the run cleanly.

torch.distributed.run's agent turns SIGTERM/SIGINT into an exception: it forwards the signal to the
workers, waits for them (``--shutdown-timeout``, 30 s by default, then SIGKILL), and re-raises, so the
command exits 1 with a traceback even when every worker saved its checkpoint and exited 0. Its exit
code cannot be changed from the workers: after the signal the agent no longer looks at them.

This launcher runs the same agent in-process with the same arguments, but takes SIGTERM and SIGINT out
of the agent's ``--signals-to-handle`` and handles them itself: the first one is forwarded to the
workers and the agent keeps monitoring them as in a normal run, so workers that save and exit 0 make
the command exit 0, and a worker that fails makes it fail as usual. A second signal (the workers did
not stop) or a signal before the workers exist falls back to the agent's own behaviour. Other signals
(SIGHUP, SIGQUIT, ...) are left to the agent.

    python tools/launch.py --nproc-per-node=8 pretrain_gpt.py +experiment=llama8b_8gpu   # torchrun's arguments
"""

from __future__ import annotations

import os
import signal

from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.run import parse_args, run

STOP_SIGNALS = ("SIGTERM", "SIGINT")


def child_pids(parent: int) -> list[int]:
    """The processes whose parent is ``parent`` (Linux /proc): the agent's workers."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        except OSError:  # exited meanwhile
            continue
        if int(fields[1]) == parent:
            pids.append(int(entry))
    return pids


class ForwardStopSignals:
    """First SIGTERM/SIGINT: forward to the workers and let the agent watch them finish. Second one, or
    no workers yet: the agent's behaviour (raise SignalException: it stops the workers and exits 1)."""

    def __init__(self):
        self.forwarded = False
        for name in STOP_SIGNALS:
            signal.signal(getattr(signal, name), self.handle)

    def handle(self, signum, frame):
        workers = child_pids(os.getpid())
        if self.forwarded or not workers:
            raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))
        self.forwarded = True
        for pid in workers:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass


def without_stop_signals(signals: str) -> str:
    kept = [s.strip() for s in signals.split(",") if s.strip() and s.strip() not in STOP_SIGNALS]
    return ",".join(kept) or "SIGQUIT"  # the agent needs at least one name


@record
def main(argv=None) -> None:
    args = parse_args(argv)
    args.signals_to_handle = without_stop_signals(args.signals_to_handle)
    ForwardStopSignals()
    run(args)
