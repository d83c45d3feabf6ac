"""Run a function in several local processes joined by a gloo process group (for tests and tools)."""

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)  # the ranks share two cores
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        results.put((rank, True, fn(*args)))
    except BaseException:  # report any failure to the parent, with its traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 600):
    """Call ``fn(*args)`` on ``world_size`` spawned ranks; return the per-rank results, raise on any failure.

    ``fn`` must be importable (a module-level function) because the ranks are spawned, not forked.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results)) for r in range(world_size)]
    for p in procs:
        p.start()
    out, errors = {}, []
    try:
        for _ in range(world_size):
            rank, ok, value = results.get(timeout=timeout)
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break  # the other ranks are likely stuck in a collective
    finally:
        for p in procs:
            p.join(timeout=5 if errors else timeout)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [out[r] for r in range(world_size)]


def read_metrics(run_dir) -> list[dict]:
    """The training lines of ``metrics.jsonl`` (evaluation lines left out)."""
    import json

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "loss" in r]


def run_pretrain(run_dir, overrides=(), nproc: int = 1, timeout: float = 600, extra_env=None, check=True,
                 torchrun: bool = False):
    """Run ``pretrain_gpt.py`` on ``nproc`` local ranks (gloo on CPU); return a CompletedProcess whose
    stdout/stderr hold every rank's output. The run's files go to ``run_dir``.

    By default the ranks are started directly with torchrun's environment variables (the env://
    rendezvous a one-node torchrun sets up), which saves the launcher's own torch import per run;
    ``torchrun=True`` goes through ``torch.distributed.run`` exactly as a user does.
    """
    import subprocess
    import sys
    import tempfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = [os.path.join(root, "pretrain_gpt.py"), f"run_dir={run_dir}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *script]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=root)
    else:
        cmd = [sys.executable, *script]
        port = free_port()
        with tempfile.TemporaryDirectory() as logs:
            outs = [open(os.path.join(logs, f"{r}.out"), "w+") for r in range(nproc)]
            errs = [open(os.path.join(logs, f"{r}.err"), "w+") for r in range(nproc)]
            ranks = [subprocess.Popen(cmd, cwd=root, stdout=outs[r], stderr=errs[r], env={
                **env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r), "LOCAL_RANK": str(r),
                "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0"}) for r in range(nproc)]
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
    """DESIGN.md section 3: step 1 loss and grad norm within 1e-5 relative, every step's loss within 1e-4."""
    assert len(reference) >= steps and len(run) >= steps, (len(reference), len(run))

    def rel(a, b):
        return abs(a - b) / max(abs(b), 1e-12)

    for key in ("loss", "grad_norm"):
        assert rel(run[0][key], reference[0][key]) <= 1e-5, f"step 1 {key}: {run[0][key]} vs reference {reference[0][key]}"
    for i in range(steps):
        for key in ("loss", "grad_norm"):
            assert rel(run[i][key], reference[i][key]) <= 1e-4, (
                f"step {i + 1} {key}: {run[i][key]} vs reference {reference[i][key]}")
