"""Run a function on several local processes joined by a gloo process group (benchmarks and tests)."""

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# what the forkserver imports once for every rank it forks
PRELOAD = ["torch", "torch.distributed", "megand.training.pretrain"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, results, received):
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
    # a returned tensor travels as a handle to this process's shared memory: stay alive until the
    # parent has unpickled every result, or it would find the handle gone
    received.wait(timeout=600)


def run_distributed(fn, world_size: int, *args, timeout: float = 600):
    """Call ``fn(*args)`` on ``world_size`` new local processes; return the per-rank results, raise on any failure.

    ``fn`` must be importable (a module-level function): the ranks are forked from a fresh server process
    that has imported torch and megand's training stack once (``forkserver``), not from this process,
    whose threads and state a forked child would inherit. Each rank so skips seconds of imports.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    results, received = ctx.Queue(), ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results, received))
             for r in range(world_size)]
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
        received.set()
        for p in procs:
            p.join(timeout=5 if errors else timeout)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [out[r] for r in range(world_size)]
