"""Test harness: launch pretrain_gpt.py on local ranks, read its metrics, compare against the reference."""

import os

from megand.tools.spawn import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Multi-rank tests run on CUDA (nccl) only where the machine has a GPU for every rank of every one of
# them: a node of this many GPUs. Elsewhere they, and the one-process reference runs they are compared
# with, run on the CPU with gloo: NCCL refuses two ranks on one GPU, and a parity test must not compare
# a CPU run with a GPU one. Single-process tests run on whatever device there is.
GPUS_FOR_MULTI_RANK_TESTS = 8


def ranks_device(nproc: int, reference: bool = False) -> str:
    """Where a test run of ``nproc`` local ranks runs ("cuda" or "cpu"); ``reference``: a one-process run
    that multi-rank runs are compared with (placed as they are)."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    if nproc == 1 and not reference:
        return "cuda"
    return "cuda" if torch.cuda.device_count() >= GPUS_FOR_MULTI_RANK_TESTS else "cpu"


def ranks_env(nproc: int, reference: bool = False) -> dict:
    """The environment variables that place a test run as :func:`ranks_device` says: no visible CUDA
    device for a run kept on the CPU (megand then chooses the CPU and gloo itself)."""
    return {} if ranks_device(nproc, reference) == "cuda" else {"CUDA_VISIBLE_DEVICES": ""}


def read_metrics(run_dir) -> list[dict]:
    """The training lines of ``metrics.jsonl`` (evaluation lines left out)."""
    import json

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "loss" in r]


def run_pretrain(run_dir, overrides=(), nproc: int = 1, timeout: float = 600, extra_env=None, check=True,
                 torchrun: bool = False, preexec_fn=None, reference: bool = False):
    """Run ``pretrain_gpt.py`` on ``nproc`` local ranks (gloo on CPU); return a CompletedProcess whose
    stdout/stderr hold every rank's output. The run's files go to ``run_dir``.

    By default the ranks are started directly with torchrun's environment variables (the env://
    rendezvous a one-node torchrun sets up), which saves the launcher's own torch import per run;
    ``torchrun=True`` goes through ``torch.distributed.run`` exactly as a user does. ``preexec_fn`` runs in
    each rank's process before it starts (e.g. to set a resource limit from outside megand). The ranks run
    where :func:`ranks_device` says (``reference``: a one-process run that multi-rank runs are compared with).
    """
    import subprocess
    import sys
    import tempfile

    root = ROOT
    script = [os.path.join(root, "pretrain_gpt.py"), f"run_dir={run_dir}", *overrides]
    # the machine's cache (the measured CPU peak FLOP/s) shared by the test runs, outside the user's home
    cache = os.path.join(tempfile.gettempdir(), f"megand-test-cache-{os.getuid()}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "XDG_CACHE_HOME": cache,
           **ranks_env(nproc, reference), **(extra_env or {})}
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *script]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=root,
                              preexec_fn=preexec_fn)
    else:
        cmd = [sys.executable, *script]
        port = free_port()
        with tempfile.TemporaryDirectory() as logs:
            outs = [open(os.path.join(logs, f"{r}.out"), "w+") for r in range(nproc)]
            errs = [open(os.path.join(logs, f"{r}.err"), "w+") for r in range(nproc)]
            rank_envs = [{**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r),
                          "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
                          "GROUP_RANK": "0"} for r in range(nproc)]
            if preexec_fn is None and set(extra_env or ()) <= FORKABLE_ENV:
                ranks = [_zygote().spawn(script, rank_envs[r], root, outs[r].name, errs[r].name) for r in range(nproc)]
            else:
                ranks = [subprocess.Popen(cmd, cwd=root, stdout=outs[r], stderr=errs[r], preexec_fn=preexec_fn,
                                          env=rank_envs[r]) for r in range(nproc)]
            try:
                codes = [rank.wait(timeout=timeout) for rank in ranks]
            finally:
                for rank in ranks:
                    if rank.poll() is None:
                        rank.kill()
            read = [[(f.seek(0), f.read())[1] for f in files] for files in (outs, errs)]
            for f in outs + errs:
                f.close()
        failed = [c for c in codes if c != 0]
        proc = subprocess.CompletedProcess(cmd, failed[0] if failed else 0, "".join(read[0]), "".join(read[1]))
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} on {nproc} ranks failed ({proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def assert_parity(reference: list[dict], run: list[dict], steps: int = 10) -> None:
    """The parity tolerances: step 1 loss and grad norm within 1e-5 relative, every step's within 1e-4."""
    assert len(reference) >= steps and len(run) >= steps, (len(reference), len(run))

    def rel(a, b):
        return abs(a - b) / max(abs(b), 1e-12)

    for key in ("loss", "grad_norm"):
        assert rel(run[0][key], reference[0][key]) <= 1e-5, f"step 1 {key}: {run[0][key]} vs reference {reference[0][key]}"
    for i in range(steps):
        for key in ("loss", "grad_norm"):
            assert rel(run[i][key], reference[i][key]) <= 1e-4, (
                f"step {i + 1} {key}: {run[i][key]} vs reference {reference[i][key]}")


# Extra environment variables a forked rank may be given: none of them changes what an import does
# (``PYTHONPATH`` would: such runs start a fresh interpreter).
FORKABLE_ENV = {"XDG_CACHE_HOME"}


class _ForkedRank:
    """What run_pretrain needs of a ``Popen``, for a rank the zygote forked (not our child: it waits)."""

    def __init__(self, zygote, pid: int):
        self.zygote, self.pid, self.returncode = zygote, pid, None

    def wait(self, timeout=None):
        import subprocess

        if self.returncode is None:
            self.returncode = self.zygote.wait(self.pid, 1e9 if timeout is None else timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
        return self.returncode

    def poll(self):
        if self.returncode is None:
            self.returncode = self.zygote.wait(self.pid, 0)
        return self.returncode

    def kill(self):
        import signal

        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.wait()


class _Zygote:
    """The session's tests/rank_zygote.py process (started on first use, ended with the session)."""

    def __init__(self):
        import atexit
        import json
        import subprocess
        import sys

        self.json = json
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.rank_zygote"], cwd=ROOT, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        if self._read() != {"ready": True}:
            raise RuntimeError("the rank zygote did not start")
        atexit.register(self.proc.kill)

    def _read(self):
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the rank zygote exited ({self.proc.poll()})")
        return self.json.loads(line)

    def _ask(self, **req):
        self.proc.stdin.write(self.json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def spawn(self, argv, env, cwd, stdout, stderr) -> _ForkedRank:
        return _ForkedRank(self, self._ask(op="spawn", argv=list(argv), env=env, cwd=cwd, stdout=stdout,
                                           stderr=stderr)["pid"])

    def wait(self, pid, timeout):
        return self._ask(op="wait", pid=pid, timeout=timeout)["code"]


_ZYGOTE = []


def _zygote() -> _Zygote:
    if not _ZYGOTE or _ZYGOTE[0].proc.poll() is not None:
        _ZYGOTE[:] = [_Zygote()]
    return _ZYGOTE[0]
