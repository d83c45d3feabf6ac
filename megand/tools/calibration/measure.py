"""Timed micro-benchmarks of one device and of the process group: GEMM rates, memory-bound bandwidth,
collectives. Each measures on the device megand.core.parallel_state chose; every figure is a median."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from megand.tools.calibration.fit import bus_factor


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn, device: torch.device, min_time: float = 0.05, windows: int = 3) -> float:
    """Seconds per call of ``fn()`` after one warm-up call: the median over ``windows`` windows of the
    mean call time, each window calling ``fn`` back to back for at least ``min_time`` seconds.

    Sustained windows rather than single calls: a device shared in time (a CPU core whose scheduler
    also runs another process) is as slow as its share, and short calls timed one by one would mostly
    fall between the other process's slices and report the unshared speed."""
    fn()
    synchronize(device)
    means = []
    for _ in range(windows):
        calls, start = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            if calls % 4 == 0 or calls == 1:  # a host read per few calls (CUDA: queued kernels finish)
                synchronize(device)
                if time.perf_counter() - start >= min_time:
                    break
        synchronize(device)
        means.append((time.perf_counter() - start) / calls)
    return statistics.median(means)


def gemm_shapes(sizes) -> list[tuple[int, int, int]]:
    """Every (m, n, k) over ``sizes``: m the tokens of a micro-batch, n and k the layer's (sharded) widths."""
    return [(m, n, k) for m in sizes for n in sizes for k in sizes]


def measure_gemm(device: torch.device, dtype: torch.dtype, shapes, min_time: float = 0.05, passes: int = 3) -> list[dict]:
    """TFLOP/s of ``(m x k) @ (k x n)`` for each shape (2 m n k FLOPs): the median of ``passes`` sweeps
    over the whole grid (a window of ``min_time`` seconds per shape each), so that a busy period of a
    shared machine spreads over every shape instead of slowing a block of neighbouring ones."""
    shapes = list(shapes)
    seconds = [[] for _ in shapes]
    for _ in range(passes):
        for i, (m, n, k) in enumerate(shapes):
            a = torch.randn(m, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            out = torch.empty(m, n, device=device, dtype=dtype)
            seconds[i].append(time_call(lambda: torch.mm(a, b, out=out), device, min_time, windows=1))
    return [{"m": m, "n": n, "k": k, "tflops": 2.0 * m * n * k / statistics.median(t) / 1e12}
            for (m, n, k), t in zip(shapes, seconds)]


def memory_bound_ops(numel: int, device: torch.device, dtype: torch.dtype):
    """(name, bytes moved, function) of the elementwise work a training step does besides GEMMs: adds,
    activations, norms, softmax, an AdamW-like update. Bytes count each read and write once."""
    x = torch.randn(numel, device=device, dtype=dtype)
    y = torch.randn(numel, device=device, dtype=dtype)
    out = torch.empty_like(x)
    rows = x.view(-1, 256)
    weight = torch.ones(256, device=device, dtype=dtype)
    m, v = torch.zeros_like(x), torch.zeros_like(x)
    size = x.element_size() * numel

    def adam():  # m, v, param updates: reads grad, m, v, param; writes m, v, param
        m.mul_(0.9).add_(y, alpha=0.1)
        v.mul_(0.95).addcmul_(y, y, value=0.05)
        x.addcdiv_(m, v.sqrt().add_(1e-8), value=-1e-6)

    return [
        ("add", 3 * size, lambda: torch.add(x, y, out=out)),
        ("gelu", 2 * size, lambda: torch.nn.functional.gelu(x)),
        ("layer_norm", 2 * size, lambda: torch.nn.functional.layer_norm(rows, (256,), weight)),
        ("softmax", 2 * size, lambda: torch.softmax(rows, dim=-1)),
        ("adamw", 10 * size, adam),
    ]


def measure_memory_bandwidth(device: torch.device, dtype: torch.dtype, sizes, min_time: float = 0.05) -> list[dict]:
    """Effective GB/s of each memory-bound operation at each tensor size (elements)."""
    points = []
    for numel in sizes:
        for name, nbytes, fn in memory_bound_ops(numel, device, dtype):
            points.append({"op": name, "numel": numel, "gbps": nbytes / time_call(fn, device, min_time) / 1e9})
    return points


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "p2p", "all_to_all")


def _collective(op: str, nbytes: int, device: torch.device, group):
    """A function running one ``op`` over ``group`` whose buffer (the full gathered size for all_gather
    and reduce_scatter) is ``nbytes``; p2p is a ping-pong between the group's first two ranks."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    numel = max(n, nbytes // 4) // n * n
    full = torch.ones(numel, device=device)
    chunk = torch.ones(numel // n, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(full, chunk, group=group)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(chunk, full, group=group)
    if op == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full, group=group)
    if op == "p2p":
        first, second = (dist.get_global_rank(group, r) if group is not None else r for r in (0, 1))

        def ping_pong():  # one message each way: the timed round trip is halved
            if me == 0:
                dist.send(full, second, group=group)
                dist.recv(full, second, group=group)
            elif me == 1:
                dist.recv(full, first, group=group)
                dist.send(full, first, group=group)
        return ping_pong
    raise ValueError(f"unknown collective {op!r}")


def measure_collective(op: str, sizes, device: torch.device, group=None, reps: int = 5, batches: int = 5) -> list[dict]:
    """Seconds of one ``op`` per buffer size (bytes): ``batches`` timed batches of ``reps`` calls, each
    started together on every rank (a barrier) and as slow as the slowest rank; the median batch."""
    points = []
    for nbytes in sizes:
        fn = _collective(op, nbytes, device, group)
        fn()
        synchronize(device)
        times = []
        for _ in range(batches):
            dist.barrier(group=group)
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            synchronize(device)
            elapsed = torch.tensor([(time.perf_counter() - start) / reps], dtype=torch.float64, device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
            times.append(float(elapsed.item()) / (2 if op == "p2p" else 1))
        points.append({"bytes": int(nbytes), "seconds": statistics.median(times)})
    return points


def fitted_gbps(op: str, n: int, point: dict) -> float:
    """The bus bandwidth one measured point alone implies (for the calibration log)."""
    return bus_factor(op, n) * point["bytes"] / point["seconds"] / 1e9
