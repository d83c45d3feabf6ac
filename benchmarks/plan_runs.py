"""Shared by the planner benchmarks: run local ranks (optionally each pinned to a CPU core), read a run's
steady step time, a CPU hog for a slower "device", rank statistics.

Ranks are started directly with the environment a one-node torchrun sets up (as tests/harness.py does),
so each rank's CPU affinity can be set before it starts (``os.sched_setaffinity`` in the child).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARMUP_ITERS = 3  # steps left out of the step time (allocations, first-touch, caches)


def load_average() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def runnable() -> int:
    """Processes running or ready to run right now (the 4th field of /proc/loadavg, this one included)."""
    with open("/proc/loadavg") as f:
        return int(f.read().split()[3].split("/")[0])


def wait_for_quiet(max_runnable: int | None, timeout: float = 15.0) -> None:
    """On a shared machine: wait (at most ``timeout`` s) until the median of a few samples of the runnable
    processes is at most ``max_runnable``, so that fewer measurements fall in other jobs' busy periods.
    None: do not wait."""
    import time

    if max_runnable is None:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        samples = []
        for _ in range(5):
            samples.append(runnable())
            time.sleep(0.2)
        if statistics.median(samples) <= max_runnable:
            return


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pin(cores):
    return None if cores is None else (lambda: os.sched_setaffinity(0, cores))


def run_ranks(argv, nproc: int, cores=None, timeout: float = 900) -> None:
    """``python argv...`` on ``nproc`` local ranks (torchrun's variables); ``cores[r]``: the CPU set of rank r.
    Raises with the failing rank's output."""
    port = free_port()
    with tempfile.TemporaryDirectory() as logs:
        procs = []
        for r in range(nproc):
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": ROOT,
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r), "LOCAL_RANK": str(r),
                   "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0"}
            out = open(os.path.join(logs, f"{r}.log"), "w+")
            procs.append((subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=out,
                                           stderr=subprocess.STDOUT, preexec_fn=_pin(cores and cores[r])), out))
        try:
            codes = [p.wait(timeout=timeout) for p, _ in procs]
        finally:
            for p, _ in procs:
                if p.poll() is None:
                    p.kill()
        if any(codes):
            bad = next(r for r, c in enumerate(codes) if c)
            out = procs[bad][1]
            out.seek(0)
            raise RuntimeError(f"{' '.join(argv)}: rank {bad} exited {codes[bad]}:\n{out.read()[-4000:]}")


def steady_step_s(run_dir: str, warmup: int = WARMUP_ITERS) -> float:
    """Median ``iter_time_ms`` (seconds) of the logged steps after the first ``warmup``."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        times = [r["iter_time_ms"] for r in map(json.loads, f) if "iter_time_ms" in r and r["iter"] > warmup]
    if not times:
        raise RuntimeError(f"{run_dir}: no steps after the first {warmup}")
    return statistics.median(times) / 1e3


def measure_step(overrides, nproc: int, cores=None, workdir: str | None = None) -> float:
    """Steady step time of ``pretrain_gpt.py overrides`` on ``nproc`` ranks."""
    run_dir = tempfile.mkdtemp(dir=workdir, prefix="run-")
    run_ranks([os.path.join(ROOT, "pretrain_gpt.py"), f"run_dir={run_dir}", *overrides], nproc, cores)
    return steady_step_s(run_dir)


def measure_rounds(layouts: dict, rounds: int, nproc: int, cores_of=None, log=print, quiet: int | None = None,
                   record=None) -> dict:
    """{label: [seconds per round]}: every layout once per round, the order reversed every other round so
    that a slow period of a shared machine does not fall on the same layouts each time. ``quiet``: see
    wait_for_quiet (before each run); ``record(times)`` is called after each run (partial results)."""
    labels = list(layouts)
    times = {label: [] for label in labels}
    with tempfile.TemporaryDirectory(prefix="megand-plan-bench-") as workdir:
        for rnd in range(rounds):
            for label in (labels if rnd % 2 == 0 else labels[::-1]):
                cores = cores_of(label) if cores_of else None
                wait_for_quiet(quiet)
                seconds = measure_step(layouts[label], nproc, cores, workdir)
                times[label].append(seconds)
                log(f"  round {rnd + 1} {label}: {seconds * 1e3:.1f} ms  (load {load_average()})")
                if record:
                    record(times)
    return times


def ranks(values) -> list[float]:
    """1-based ranks, ties sharing their average rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a, b) -> float:
    """Spearman's rank correlation (Pearson's on the ranks)."""
    ra, rb = ranks(list(a)), ranks(list(b))
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return cov / var if var else float("nan")


# a busy loop that ends when its parent does (a benchmark killed outright leaves no hog behind)
HOG = "import os, sys\nparent = int(sys.argv[1])\nwhile os.getppid() == parent:\n    pass\n"


def start_hog(core: int) -> subprocess.Popen:
    """A busy loop pinned to ``core``: a rank sharing that core gets about half of it."""
    return subprocess.Popen([sys.executable, "-c", HOG, str(os.getpid())], preexec_fn=_pin({core}))


def stop_on_signals() -> None:
    """SIGTERM and SIGINT (also when started in the background, where SIGINT is ignored) unwind the
    benchmark, so its ``finally`` blocks stop the ranks and the hog."""
    import signal

    def stop_now(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop_now)


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()
