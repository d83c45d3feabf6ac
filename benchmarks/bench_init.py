"""Time and peak RSS of building one rank's model (meta build, engine buffers, initialisation).

    python benchmarks/bench_init.py [--model llama_1b] [--tp 1 8] [--precision bf16] [--rank 0]

Each tensor-parallel size runs in a fresh process that plays ``--rank`` of a world of tp ranks on torch's
fake process group (no other process exists), builds the model the way the trainer does
(``build_model_and_engine``: parameters created on the meta device, placed in the data-parallel engine's
flat buffers, then initialised tile by tile) and reports wall time, CPU time (user + system: steadier than wall time on a shared machine) and peak RSS. Prints one JSON line per
tp and a summary line with the ratios against the first tp given (the acceptance: tp=8 at most 1/4 of
tp=1 in both time and peak RSS).
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time



def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cpu_seconds() -> float:
    """User + system CPU time of this process: the wall time is unreliable on a loaded machine."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def child(args) -> dict:
    rss_start = rss_bytes()
    from megand.core.parallel_state import init_fake_distributed
    from megand.training.config import compose
    from megand.training.core_configs import core_configs
    from megand.training.pretrain import build_model_and_engine, build_topology

    cfg = compose([f"model={args.model}", f"parallel.tp={args.tp}", f"train.precision={args.precision}",
                   "run_dir=/tmp/bench_init"])
    device = init_fake_distributed(args.rank, args.tp)
    configs = core_configs(cfg, device, args.tp)
    topo = build_topology(configs, device)
    rss_before = rss_bytes()
    start, cpu_start = time.perf_counter(), cpu_seconds()
    chunks, ddp = build_model_and_engine(configs, topo)
    seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu_start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    local = sum(p.numel() for c in chunks for p in c.parameters())
    buffers = sum(b.param_data.nbytes + b.grad_data.nbytes for b in ddp.buffers)
    return {"model": args.model, "tp": args.tp, "rank": args.rank, "precision": args.precision,
            "build_s": round(seconds, 3), "build_cpu_s": round(cpu, 3), "peak_rss_bytes": peak, "rss_before_build_bytes": rss_before,
            "rss_at_start_bytes": rss_start, "local_params": local, "buffer_bytes": buffers}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama_1b", help="a conf/model preset")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 8], help="tensor-parallel sizes to compare")
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--rank", type=int, default=0, help="the rank built (within the tp group)")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)  # the tp this process builds
    args = p.parse_args(argv)
    if args.child is not None:
        args.tp = args.child
        print(json.dumps(child(args)), flush=True)
        return
    results = []
    for tp in args.tp:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", str(tp), "--model", args.model,
               "--precision", args.precision, "--rank", str(args.rank)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    base = results[0]
    for r in results[1:]:
        time_ratio = r["build_s"] / base["build_s"]
        cpu_ratio = r["build_cpu_s"] / base["build_cpu_s"]
        rss_ratio = r["peak_rss_bytes"] / base["peak_rss_bytes"]
        grown = (r["peak_rss_bytes"] - r["rss_before_build_bytes"]) / (base["peak_rss_bytes"] - base["rss_before_build_bytes"])
        print(json.dumps({"summary": f"tp={r['tp']} vs tp={base['tp']}", "time_ratio": round(time_ratio, 3), "cpu_time_ratio": round(cpu_ratio, 3),
                          "peak_rss_ratio": round(rss_ratio, 3), "rss_growth_ratio": round(grown, 3),
                          "within_quarter": max(time_ratio, cpu_ratio, rss_ratio) <= 0.25}), flush=True)


if __name__ == "__main__":
    main()
