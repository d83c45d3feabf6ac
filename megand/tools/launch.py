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

Configuration errors are found before any worker starts: for ``pretrain_gpt.py`` the launcher composes the
run's config from the same overrides and validates it at the launch's world size, so a bad value is one
line (``megand: invalid configuration: ...``) and exit code 2, and ``--max-restarts`` never retries it.
A worker failure is one line naming the rank and its exit code (the worker's own line is above it), and
the launcher exits with that code.

Nodes of different process counts (a heterogeneous plan from tools/plan.py: each node's command its own
``--nproc-per-node``, the nodes of one GPU type running wider or more stages than another's) take
``--world-size=N``, the processes of all nodes together (torchrun itself sums them at rendezvous; the
launcher needs it to validate the run before any worker starts):

    python tools/launch.py --world-size=12 --nnodes=2 --node-rank=1 --nproc-per-node=4 pretrain_gpt.py ...

An elastic launch (``--nnodes=MIN:MAX``) is validated at every world size it may run at (a restart on
fewer nodes must not fail on a configuration it could have refused now; megand/training/elastic.py has
the rule), and its agents' rendezvous keeps no store across rounds (:data:`ELASTIC_ENV`).
"""

from __future__ import annotations

import os
import signal

import sys

from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

TRAINING_SCRIPT = "pretrain_gpt.py"

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


class LaunchError(ValueError):
    """Launcher arguments that cannot run; the message names the values."""


def split_world_size(argv) -> tuple:
    """``(--world-size's value or None, the other arguments)``: the launcher's own flag, taken out before
    torchrun's parser (which does not know it) sees the rest. A bad value: LaunchError."""
    argv, world, rest, i = list(argv), None, [], 0
    while i < len(argv):
        a = argv[i]
        if a == TRAINING_SCRIPT or a.endswith("/" + TRAINING_SCRIPT) or not a.startswith("-"):
            rest += argv[i:]  # the training script and its arguments: not the launcher's
            break
        if a == "--world-size" or a.startswith("--world-size="):
            value = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in a else 2
            if not value.isdigit() or int(value) < 1:
                raise LaunchError(f"launch: --world-size={value} must be a positive number of processes")
            world = int(value)
            continue
        rest.append(a)
        i += 1
    return world, rest


def launch_world_sizes(args) -> list[int]:
    """Every world size the launch may run at: one (``--world-size`` when the nodes run different numbers of
    processes), or one per node count of an elastic range (``--nnodes=MIN:MAX``); none when the arguments
    do not say (``--nproc-per-node=gpu``)."""
    world = getattr(args, "world_size", None)
    if world is not None:
        return [world]
    nnodes, nproc = str(args.nnodes), str(args.nproc_per_node)
    low, _, high = nnodes.partition(":")
    if not nproc.isdigit() or not low.isdigit() or not (high or low).isdigit():
        return []
    return [n * int(nproc) for n in range(int(low), int(high or low) + 1)]


def is_elastic(args) -> bool:
    return len(launch_world_sizes(args)) > 1


# torch's agents share one TCP store across rendezvous rounds unless this is "1"; a node that joins a running
# job (an elastic scale-up) then waits for a key the existing rank-0 agent never writes for the new round, and
# the workers' own keys of earlier rounds linger. Per round, rank 0's worker hosting a new store avoids both.
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def config_error(args) -> str | None:
    """The one-line configuration error of a ``pretrain_gpt.py`` launch, found before spawning, or None.
    A run that takes its model from a checkpoint (``checkpoint.load`` and no model given) is left to the
    workers, which read the checkpoint."""
    if os.path.basename(args.training_script) != TRAINING_SCRIPT:
        return None
    worlds = launch_world_sizes(args)
    overrides = [a for a in args.training_script_args if not a.startswith("-")]
    if not worlds or len(overrides) != len(args.training_script_args):
        return None  # Hydra flags (--cfg, --multirun, ...) and unknown sizes: the workers check
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from megand.training.config import ConfigError, compose, validate

    try:
        cfg = compose(overrides)
    except (HydraException, OmegaConfBaseException) as e:
        return "megand: invalid configuration: " + " ".join(str(e).split())
    takes_model = any(o.split("=", 1)[0].lstrip("+~").split(".")[0] == "model" for o in overrides)
    if cfg.checkpoint.load and not takes_model:
        return None
    for world in worlds:  # an elastic launch: valid at every node count it may restart on
        try:
            validate(cfg, world)  # a fixed parallel.dp fails at every other world size
        except ConfigError as e:
            at = f"at --nnodes={args.nnodes} x {args.nproc_per_node} = world size {world}: " if len(worlds) > 1 else ""
            return f"megand: invalid configuration: {at}{e}"
    return None


def first_failure(e: ChildFailedError) -> tuple[int, int]:
    """``(global rank, exit code)`` of the first worker that failed."""
    rank, failure = e.get_first_failure()
    return rank, failure.exitcode


def main(argv=None) -> None:
    try:
        world, argv = split_world_size(sys.argv[1:] if argv is None else argv)
    except LaunchError as e:
        print(e, file=sys.stderr, flush=True)
        sys.exit(2)
    args = parse_args(argv)
    args.world_size = world
    if world is not None:
        low, _, high = str(args.nnodes).partition(":")
        nproc = str(args.nproc_per_node)
        if high and high != low:
            print(f"launch: --world-size={world} with an elastic --nnodes={args.nnodes}: nodes of different process "
                  f"counts run at one fixed size", file=sys.stderr, flush=True)
            sys.exit(2)
        if nproc.isdigit() and low.isdigit() and int(nproc) + int(low) - 1 > world:
            print(f"launch: --world-size={world} is fewer processes than this node's --nproc-per-node={nproc} and "
                  f"one on each of the other {int(low) - 1} node(s)", file=sys.stderr, flush=True)
            sys.exit(2)
    message = config_error(args)
    if message:  # before any worker: not retried by --max-restarts, and one line
        print(message, file=sys.stderr, flush=True)
        sys.exit(2)
    if is_elastic(args):
        for key, value in ELASTIC_ENV.items():
            os.environ.setdefault(key, value)
    args.signals_to_handle = without_stop_signals(args.signals_to_handle)
    ForwardStopSignals()
    try:
        run(args)
    except ChildFailedError as e:  # the worker printed its own line; torchrun's 30-line report is not repeated
        rank, code = first_failure(e)
        print(f"launch: {os.path.basename(args.training_script)} failed: rank {rank} exited with code {code}"
              f"{' (killed by a signal)' if code < 0 else ''}", file=sys.stderr, flush=True)
        sys.exit(code if 0 < code < 256 else 1)
