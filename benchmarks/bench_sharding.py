"""Sharding levels of the data-parallel engine at dp=4: resident state, step time and traffic.

    python benchmarks/bench_sharding.py [--steps 5] [--hidden 128] [--bucket-size 50000]

For each level (none, optim, optim_grads, optim_grads_params, and ZeRO-3 with reshard_after_forward=false),
in bf16 on 4 ranks, one micro-batch per rank per step:
- ``state_bytes``: resident params + grads + optimizer state per parameter at the step boundary (the
  metrics.jsonl figure) against the theory in bf16 at shard size d: 18 / 6+12/d / 2+16/d / 18/d bytes per parameter
  (none / optim / optim_grads / optim_grads_params);
- median step time (after one warm-up step);
- bytes this rank moved per step by all-gather, reduce-scatter and all-reduce (the engine's own counters:
  ring volume (d-1)/d of each full buffer, twice for all-reduce) against the theory per micro-batch:
  ZeRO-3 all-gathers the bf16 parameters in forward and again in backward (once with
  reshard_after_forward=false) and reduce-scatters the fp32 gradients once:
  ``(2 or 1) x P x 2 x (d-1)/d`` gathered and ``P x 4 x (d-1)/d`` scattered, i.e. the issue's
  ``3 x parameter bytes x (d-1)/d`` when the gradient is reduced in the parameters' dtype (ours is fp32).
"""

import argparse
import json
import statistics
import tempfile
import time

D = 4
LEVELS = {  # name: overrides
    "none": ["optim.sharding=none"],
    "optim": ["optim.sharding=optim"],
    "optim_grads": ["optim.sharding=optim_grads"],
    "optim_grads_params": ["optim.sharding=optim_grads_params"],
    "optim_grads_params keep": ["optim.sharding=optim_grads_params", "optim.reshard_after_forward=false"],
}
THEORY_BYTES_PER_PARAM = {"none": 18, "optim": 6 + 12 / D, "optim_grads": 2 + 16 / D, "optim_grads_params": 18 / D,
                          "optim_grads_params keep": 18 / D}


def build_trainer(overrides):
    from megand.training.config import compose
    from megand.training.pretrain import Trainer

    return Trainer(compose(["+experiment=tiny_llama", f"run_dir={tempfile.mkdtemp()}", *overrides]))


def theory_traffic(level, params):
    """Bytes per rank per step (one micro-batch) of each collective, for P = ``params`` elements."""
    ring = (D - 1) / D
    if level == "none":
        return {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 2 * ring * 4 * params}
    gathers = {"optim": 1, "optim_grads": 1, "optim_grads_params": 2, "optim_grads_params keep": 1}[level]
    return {"all_gather": gathers * ring * 2 * params, "reduce_scatter": ring * 4 * params, "all_reduce": 0}


def worker(model, steps):
    import torch.distributed as dist

    out = {}
    for level, overrides in LEVELS.items():
        t = build_trainer(model + overrides + [f"train.iters={steps + 1}", "train.precision=bf16",
                                               "train.global_batch_size=8", "train.micro_batch_size=2"])
        times, traffic = [], None
        for k in range(steps + 1):
            before = dict(t.ddp.traffic)
            dist.barrier()
            start = time.perf_counter()
            t.train_step()
            t.iteration += 1
            times.append(time.perf_counter() - start)
            traffic = {key: t.ddp.traffic[key] - before[key] for key in before}
        n = sum(p.numel() for p in t.params)
        out[level] = {"params": n, "state_bytes_per_param": t.optimizer.state_bytes() / n,
                      "median_step_ms": 1e3 * statistics.median(times[1:]), "traffic": traffic,
                      "theory": theory_traffic(level, n), "max_gathered_buckets": getattr(t.ddp, "max_gathered", 0),
                      "buckets": len(t.ddp.buckets)}
    return out


def main():
    from megand.tools.spawn import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--bucket-size", type=int, default=50_000)
    args = parser.parse_args()
    model = [f"model.hidden_size={args.hidden}", f"model.ffn_hidden_size={args.hidden * 11 // 4}",
             f"optim.bucket_size={args.bucket_size}"]
    results = run_distributed(worker, D, model, args.steps)[0]
    print(f"dp={D}, bf16, rank 0; traffic in KiB per step per rank (measured / theory)")
    print(f"  {'level':24s} {'B/param':>8s} {'theory':>7s} {'ms/step':>8s} {'all-gather':>17s} {'reduce-scatter':>17s}"
          f" {'all-reduce':>17s}  gathered<=")
    for level, row in results.items():
        cells = [f"{row['traffic'][k] / 1024:7.1f}/{row['theory'][k] / 1024:7.1f}"
                 for k in ("all_gather", "reduce_scatter", "all_reduce")]
        print(f"  {level:24s} {row['state_bytes_per_param']:8.2f} {THEORY_BYTES_PER_PARAM[level]:7.2f} "
              f"{row['median_step_ms']:8.1f} {cells[0]:>17s} {cells[1]:>17s} {cells[2]:>17s}  "
              f"{row['max_gathered_buckets']}/{row['buckets']}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
