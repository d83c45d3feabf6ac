"""Forward+backward time of context-parallel causal attention at cp=1,2,4 (gloo, CPU, one thread per rank),
and the share of the ring's communication hidden behind compute.

    OMP_NUM_THREADS=1 python benchmarks/bench_cp_attention.py [--seq 4096 --heads 8 --groups 8 --head-dim 64]

Printed per cp and variant: the slowest rank's time, best of --iters (median in brackets), after a warm-up:
  fwd+bwd   one forward and backward of the attention on the local tokens (total sequence fixed)
  local     ring only: the same code with every send/recv replaced by a local copy (no communication)
  comm      ring only: the ring's messages alone (same sizes and order, each waited at once, no compute)
  hidden    1 - (fwd+bwd - local) / comm from the best times: the share of communication that compute covered
  blocked   ring only: the time a rank spends blocked in the ring's wait() calls per fwd+bwd (max over
            ranks): the communication compute did not cover, plus waiting for a late neighbour
  cpu       the slowest rank's process CPU time (all its threads, gloo's included), best of --iters:
            insensitive to other processes on the machine, unlike the wall times
  max_rss   peak resident memory of the rank process
The ranks share the machine's cores: with more ranks than cores they time-slice, which inflates every
figure; compare cp sizes with that in mind.
"""

import argparse
import importlib
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megand.core.context_parallel import all_gather_attention, ring_attention, split_for_cp  # noqa: E402
from megand.tools.spawn import run_distributed  # noqa: E402

# the module itself (the package exports a function of the same name), to swap its send/recv for local copies
ring_module = importlib.import_module("megand.core.context_parallel.ring_attention")


def _slowest(fn):
    """The slowest rank's (wall time, process CPU time) of one call of fn()."""
    dist.barrier()
    start, start_cpu = time.perf_counter(), time.process_time()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start, time.process_time() - start_cpu], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.tolist()


def _local_copy(send_buf, group):
    """Stand-in for ring_attention._ring_send_recv: what would arrive is replaced by a copy of what we send."""
    return send_buf.clone(), []


class _TimedRequest:
    """Wraps a p2p request to add the time the ring spends blocked in its wait() to a list.
    (gloo's p2p requests only notice completion inside wait(), so is_completed() cannot tell.)"""

    def __init__(self, req, blocked_s):
        self.req, self.blocked_s = req, blocked_s

    def wait(self):
        start = time.perf_counter()
        self.req.wait()
        self.blocked_s.append(time.perf_counter() - start)


def _bench(seq, heads, groups, head_dim, iters):
    group, rank, cp = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    q, dout = (split_for_cp(torch.randn(1, heads, seq, head_dim, generator=gen), 2, rank, cp) for _ in range(2))
    k, v = (split_for_cp(torch.randn(1, groups, seq, head_dim, generator=gen), 2, rank, cp) for _ in range(2))

    def fwd_bwd(attention):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        attention(*leaves, group).backward(dout)

    def ring_messages():  # forward: cp-1 K/V hops; backward: cp-1 K/V hops and cp fp32 dK/dV hops
        for buf, hops in ((torch.stack([k, v]), 2 * (cp - 1)), (torch.zeros(2, *k.shape), cp)):
            for _ in range(hops):
                buf, reqs = ring_module._ring_send_recv(buf, group)
                for req in reqs:
                    req.wait()

    def ring_local_copies():
        real_send_recv, ring_module._ring_send_recv = ring_module._ring_send_recv, _local_copy
        try:
            fwd_bwd(ring_attention)
        finally:
            ring_module._ring_send_recv = real_send_recv

    blocked_s = []  # time blocked in each wait of the ring: communication not covered by compute (or a late peer)

    def ring_probed():
        real_send_recv = ring_module._ring_send_recv

        def probed(send_buf, group):
            recv_buf, reqs = real_send_recv(send_buf, group)
            return recv_buf, [_TimedRequest(req, blocked_s) for req in reqs]

        ring_module._ring_send_recv = probed
        try:
            fwd_bwd(ring_attention)
        finally:
            ring_module._ring_send_recv = real_send_recv

    variants = {"ring": lambda: fwd_bwd(ring_attention), "all_gather": lambda: fwd_bwd(all_gather_attention)}
    if cp > 1:
        variants.update(local=ring_local_copies, comm=ring_messages, probed=ring_probed)
    # the variants take turns within each iteration so that load from other processes hits them alike
    times = {name: [] for name in variants}
    for i in range(iters + 1):
        for name, fn in variants.items():
            elapsed = _slowest(fn)
            if i:  # the first round warms up
                times[name].append(elapsed)
        if i == 0:
            blocked_s.clear()
    result = {name: (min(t[0] for t in ts), statistics.median(t[0] for t in ts), min(t[1] for t in ts))
              for name, ts in times.items()}
    if cp > 1:  # per fwd+bwd, the most any rank was blocked
        blocked = torch.tensor(sum(blocked_s) / iters, dtype=torch.float64)
        dist.all_reduce(blocked, op=dist.ReduceOp.MAX)
        result["blocked"] = blocked.item()
    rss = torch.tensor(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, dtype=torch.float64)
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    result["max_rss_gib"] = rss.item() / 2**30
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--groups", type=int, default=8, help="K/V heads (GQA when < --heads)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    print(f"causal attention fwd+bwd, fp32, b=1, seq={args.seq}, heads={args.heads}, kv heads={args.groups}, "
          f"head dim={args.head_dim}; gloo, 1 thread per rank, {torch.get_num_threads()} threads here")
    for cp in args.cp:
        r = run_distributed(_bench, cp, args.seq, args.heads, args.groups, args.head_dim, args.iters)[0]
        line = (f"cp={cp}: ring fwd+bwd {r['ring'][0]:.3f} s ({r['ring'][1]:.3f}) cpu {r['ring'][2]:.3f} s | "
                f"all_gather {r['all_gather'][0]:.3f} s ({r['all_gather'][1]:.3f}) cpu {r['all_gather'][2]:.3f} s")
        if cp > 1:
            hidden = 1 - (r["ring"][0] - r["local"][0]) / r["comm"][0]
            line += (f" | ring local copies {r['local'][0]:.3f} s ({r['local'][1]:.3f}), "
                     f"cpu {r['local'][2]:.3f} s, comm alone {r['comm'][0]:.3f} s ({r['comm'][1]:.3f}), hidden {100 * hidden:.0f}%, "
                     f"blocked in ring waits {r['blocked']:.3f} s")
        print(line + f" | max_rss {r['max_rss_gib']:.2f} GiB", flush=True)


if __name__ == "__main__":
    main()
