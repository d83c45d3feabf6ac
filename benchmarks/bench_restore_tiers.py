"""Time to restore from the node-local tier against the shared tier, on two "nodes" (two torchrun agents on
this machine, each with its own local directory) at dp=4:

    python benchmarks/bench_restore_tiers.py --out /tmp/bench_tiers                 # tiny_gpt
    python benchmarks/bench_restore_tiers.py --out /tmp/bench_tiers model=llama_50m  # any model override

Trains ``--iters`` steps saving to both tiers at the end, then restarts the same command (which restores
and trains nothing more) ``--repeats`` times in each of three ways: from the local tier with every node's
directory intact; from the local tier after node 1's directory is deleted (its ranks' states come from the
replicas on node 0, over the network); from the shared tier (both local directories deleted). Each restart's
``checkpoint_restored`` event gives the seconds the restore took (for the local tier: choosing the state,
checking it, reading and sending it; for the shared tier: the checksums and the read) and the bytes read
from each tier. Prints one line per restart, then one JSON line with the medians.

Both tiers live on this machine's one file system here, usually in its page cache: the figures compare the
two restore paths, not a node's disk with a shared file system (which is where the local tier gains).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NPROC, NODES = 2, 2


def job(run_dir, overrides, local_dirs, port) -> None:
    """The two agents of one job (static rendezvous on this machine), waited for; a failure raises."""
    agents = []
    for node in range(NODES):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={NODES}", f"--node-rank={node}",
               "--master-addr=127.0.0.1", f"--master-port={port}", f"--nproc-per-node={NPROC}",
               os.path.join(ROOT, "pretrain_gpt.py"), f"run_dir={run_dir}", *overrides,
               f"checkpoint.local_dir={local_dirs[node]}"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
        agents.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True))
    outputs = [a.communicate()[0] for a in agents]
    if any(a.returncode for a in agents):
        raise SystemExit(f"job failed:\n{outputs[0][-3000:]}\n{outputs[1][-3000:]}")


def last_restore(run_dir) -> dict:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r.get("event") == "checkpoint_restored"][-1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="a scratch directory (emptied first)")
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--port", type=int, default=29731)
    parser.add_argument("overrides", nargs="*", help="pretrain_gpt.py overrides (e.g. model=llama_50m)")
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    save, run_dir = os.path.join(args.out, "ckpt"), os.path.join(args.out, "run")
    locals_ = [os.path.join(args.out, f"local{n}") for n in range(NODES)]
    overrides = ["+experiment=tiny_gpt", "train.eval_iters=0", f"train.iters={args.iters}",
                 f"checkpoint.save={save}", f"checkpoint.load={save}", f"checkpoint.interval={args.iters}",
                 f"checkpoint.local_interval={args.iters}", *args.overrides]
    job(run_dir, overrides, locals_, args.port)
    kept = {n: os.path.join(args.out, f"kept{n}") for n in range(NODES)}
    for n in range(NODES):  # the local tier as the first run left it, copied back before each restart
        shutil.copytree(locals_[n], kept[n])
    ways = {"local": (), "local, node 1 lost": (1,), "shared": (0, 1)}
    results = {way: [] for way in ways}
    for repeat in range(args.repeats):
        for way, lost in ways.items():
            for n in range(NODES):
                shutil.rmtree(locals_[n], ignore_errors=True)
                if n not in lost:
                    shutil.copytree(kept[n], locals_[n])
            job(run_dir, overrides, locals_, args.port)
            r = last_restore(run_dir)
            assert r["tier"] == way.split(",")[0], r
            results[way].append(r)
            print(f"{way:>20}: {r['seconds']:.3f} s, {r['bytes_local'] / 2**20:.2f} MiB local, "
                  f"{r['bytes_shared'] / 2**20:.2f} MiB shared ({r['bytes_shared']} bytes), "
                  f"from replicas: {r['from_replica']}", flush=True)
    summary = {way: {"seconds_median": round(statistics.median(r["seconds"] for r in rs), 4),
                     "bytes_local": rs[-1]["bytes_local"], "bytes_shared": rs[-1]["bytes_shared"]}
               for way, rs in results.items()}
    print(json.dumps({"restore_tiers": summary, "repeats": args.repeats, "overrides": args.overrides}))


if __name__ == "__main__":
    main()
