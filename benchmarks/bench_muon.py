"""AdamW against Muon on the same tokens: loss curves and time per step (the Newton-Schulz cost).

    python benchmarks/bench_muon.py [--iters 80] [--adamw-lr 1e-3 3e-3] [--muon-lr 3e-3 1e-2] [--out muon.json]

One process, ``model=llama_50m`` on the quickstart corpus (the standard library's pydoc topics, built
offline on first use), the same seed, data order and global batch for every run; a WSD schedule (the LR
stays at its peak, then decays over the last fifth) so the runs differ only in the optimizer and its
peak LR. Prints, per run, the loss every ``--every`` steps, the final validation loss and the median time
per step after the first two; ``--out`` keeps everything as JSON.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(name, lr, args, workdir):
    run_dir = os.path.join(workdir, f"{name}_{lr:g}")
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "+experiment=quickstart", "model=llama_50m",
           "parallel.tp=1", "parallel.sequence_parallel=false", f"train.iters={args.iters}",
           f"train.global_batch_size={args.batch}", f"train.micro_batch_size={args.batch}", "train.log_interval=1",
           "train.eval_interval=0", "train.eval_iters=4", f"optim.name={name}", f"optim.lr={lr}",
           f"optim.min_lr={lr / 10}", "optim.schedule=wsd", "optim.warmup_iters=10",
           f"run_dir={run_dir}", f"data.cache_dir={os.path.join(workdir, 'cache')}"]
    subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": ROOT})
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    steps = [r for r in records if "loss" in r]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    return {"optimizer": name, "lr": lr, "loss": [r["loss"] for r in steps],
            "val_loss": val[-1] if val else None,
            "median_step_ms": statistics.median(r["iter_time_ms"] for r in steps[2:])}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=80)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences of 256 tokens)")
    parser.add_argument("--adamw-lr", type=float, nargs="+", default=[1e-3, 3e-3])
    parser.add_argument("--muon-lr", type=float, nargs="+", default=[3e-3, 1e-2])
    parser.add_argument("--every", type=int, default=10, help="print the loss every N steps")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="bench_muon_")
    results = [run(name, lr, args, workdir) for name, lrs in (("adamw", args.adamw_lr), ("muon", args.muon_lr))
               for lr in lrs]
    shown = list(range(args.every - 1, args.iters, args.every))
    print(f"{'run':<16}" + "".join(f"{f'step {i + 1}':>10}" for i in shown) + f"{'val loss':>10}{'ms/step':>10}")
    for r in results:
        print(f"{r['optimizer'] + ' lr=' + format(r['lr'], 'g'):<16}" + "".join(f"{r['loss'][i]:>10.3f}" for i in shown)
              + f"{r['val_loss']:>10.3f}{r['median_step_ms']:>10.0f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"iters": args.iters, "batch": args.batch, "runs": results}, f)


if __name__ == "__main__":
    main()
