"""Forward+backward time of context-parallel causal attention at cp=1,2,4 (gloo, CPU, one thread per rank):
ring (p2p), all_gather and a2a (Ulysses: heads re-sharded over cp; --heads must divide by every cp).

    OMP_NUM_THREADS=1 python benchmarks/bench_cp_attention.py [--seq 4096 --heads 8 --groups 8 --head-dim 64]

Printed per cp and variant: the slowest rank's time, best of --iters (median in brackets), after a warm-up:
  fwd+bwd   one forward and backward of the attention on the local tokens (total sequence fixed)
  comm      ring only: messages of the ring's sizes and count alone (each waited at once, no compute),
            sent with plain batch_isend_irecv
  cpu       the slowest rank's process CPU time (all its threads, gloo's included), best of --iters:
            insensitive to other processes on the machine, unlike the wall times
  max_rss   peak resident memory of the rank process
The ranks share the machine's cores: with more ranks than cores they time-slice, which inflates every
figure; compare cp sizes with that in mind.
"""

import argparse
import resource
import statistics
import time

import torch
import torch.distributed as dist

from megand.core.context_parallel import all_gather_attention, ring_attention, split_for_cp
from megand.core.context_parallel.ulysses import ulysses_attention
from megand.tools.spawn import run_distributed


def _slowest(fn):
    """The slowest rank's (wall time, process CPU time) of one call of fn()."""
    dist.barrier()
    start, start_cpu = time.perf_counter(), time.process_time()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start, time.process_time() - start_cpu], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.tolist()


def _bench(seq, heads, groups, head_dim, iters):
    group, rank, cp = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    q, dout = (split_for_cp(torch.randn(1, heads, seq, head_dim, generator=gen), 2, rank, cp) for _ in range(2))
    k, v = (split_for_cp(torch.randn(1, groups, seq, head_dim, generator=gen), 2, rank, cp) for _ in range(2))

    def fwd_bwd(attention):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        attention(*leaves, group).backward(dout)

    def ring_messages():  # forward: cp-1 K/V hops; backward: cp-1 K/V hops and cp fp32 dK/dV hops
        nxt, prv = (rank + 1) % cp, (rank - 1) % cp
        for buf, hops in ((torch.stack([k, v]), 2 * (cp - 1)), (torch.zeros(2, *k.shape), cp)):
            for _ in range(hops):
                recv = torch.empty_like(buf)
                reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, buf, nxt, group),
                                               dist.P2POp(dist.irecv, recv, prv, group)])
                for req in reqs:
                    req.wait()
                buf = recv

    variants = {"ring": lambda: fwd_bwd(ring_attention), "all_gather": lambda: fwd_bwd(all_gather_attention),
                "a2a": lambda: fwd_bwd(ulysses_attention)}
    if cp > 1:
        variants.update(comm=ring_messages)
    # the variants take turns within each iteration so that load from other processes hits them alike
    times = {name: [] for name in variants}
    for i in range(iters + 1):
        for name, fn in variants.items():
            elapsed = _slowest(fn)
            if i:  # the first round warms up
                times[name].append(elapsed)
    result = {name: (min(t[0] for t in ts), statistics.median(t[0] for t in ts), min(t[1] for t in ts))
              for name, ts in times.items()}
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
                f"all_gather {r['all_gather'][0]:.3f} s ({r['all_gather'][1]:.3f}) cpu {r['all_gather'][2]:.3f} s | "
                f"a2a {r['a2a'][0]:.3f} s ({r['a2a'][1]:.3f}) cpu {r['a2a'][2]:.3f} s")
        if cp > 1:
            line += f" | ring messages alone {r['comm'][0]:.3f} s ({r['comm'][1]:.3f})"
        print(line + f" | max_rss {r['max_rss_gib']:.2f} GiB", flush=True)


if __name__ == "__main__":
    main()
