"""Measure the data-parallel engine and the optimizer on this machine.

    python benchmarks/bench_optimizer.py [--steps 10] [--hidden 128]

1. Bytes per parameter held per rank at dp=4 (parameter buffer + fp32 grad buffer + the optimizer's
   own tensors, measured, divided by the rank's parameter count) for fp32/bf16 x distributed off/on,
   next to the theoretical figures (mixed precision: 18, distributed: 6 + 12/dp).
2. Step time at dp=2 (distributed optimizer, several buckets) with overlap_grad_reduce and
   overlap_param_gather on vs off (median over --steps after one warm-up step, the two runs alternating).
"""

import argparse
import json
import os
import statistics
import tempfile
import time


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_trainer(overrides):
    from megand.training.config import compose
    from megand.training.pretrain import Trainer

    cfg = compose(["+experiment=tiny_llama", f"run_dir={tempfile.mkdtemp()}", *overrides])
    return Trainer(cfg)


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def memory_worker(model):
    out = {}
    for precision in ("fp32", "bf16"):
        for distributed in (False, True):
            t = build_trainer(model + [f"train.precision={precision}", f"optim.sharding={'optim' if distributed else 'none'}"])
            n = sum(p.numel() for p in t.params)
            params = nbytes(b.param_data for b in t.ddp.buffers)
            grads = nbytes(b.grad_data for b in t.ddp.buffers)
            state = nbytes(t.optimizer.state_tensors())
            out[f"{precision} distributed={distributed}"] = {
                "params": n, "param_bytes": params / n, "grad_bytes": grads / n, "optimizer_bytes": state / n,
                "total_bytes_per_param": (params + grads + state) / n}
    return out


def time_worker(model, steps):
    """Both runs built side by side and stepped alternately, so load changes on a shared machine hit both."""
    import torch.distributed as dist

    runs = {overlap: build_trainer(model + ["optim.sharding=optim", "optim.bucket_size=50000",
                                            f"train.iters={steps + 1}", f"optim.overlap_grad_reduce={overlap}",
                                            f"optim.overlap_param_gather={overlap}"])
            for overlap in ("false", "true")}
    times = {overlap: [] for overlap in runs}
    for _ in range(steps + 1):
        for overlap, t in runs.items():
            dist.barrier()
            start = time.perf_counter()
            t.step()
            times[overlap].append(time.perf_counter() - start)
    return {f"overlap={o}": {"median_step_ms": 1e3 * statistics.median(times[o][1:]), "buckets": len(runs[o].ddp.buckets)}
            for o in runs}


def main():
    from megand.tools.spawn import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=128)
    args = parser.parse_args()
    model = [f"model.hidden_size={args.hidden}", f"model.ffn_hidden_size={args.hidden * 11 // 4}"]
    memory = run_distributed(memory_worker, 4, model)[0]
    print("bytes per parameter per rank at dp=4 (theory: bf16 18 plain, 6 + 12/4 = 9 distributed; "
          "fp32 16 plain, 8 + 8/4 = 10 distributed)")
    for key, row in memory.items():
        print(f"  {key:26s} total {row['total_bytes_per_param']:6.2f} = param {row['param_bytes']:.2f} + grad "
              f"{row['grad_bytes']:.2f} + optimizer {row['optimizer_bytes']:.2f}   ({row['params']} params/rank)")
    timing = run_distributed(time_worker, 2, model, args.steps)[0]
    print("step time at dp=2, distributed optimizer:")
    for key, row in timing.items():
        print(f"  {key:14s} {row['median_step_ms']:8.1f} ms/step ({row['buckets']} buckets)")
    print(json.dumps({"memory_dp4": memory, "time_dp2": timing}))


if __name__ == "__main__":
    main()
