"""Step time with the weight gradients of the parallel linear layers added straight into the fp32
accumulator (``accumulate_grad``, the default) against autograd's ``p.grad`` added by the engine's hook,
one process, the two alternating step by step on one trainer (the second side simply hides the
parameters' ``accumulate_grad``), so both see the same load drift. Prints one JSON line: each side's
best wall and process-CPU time per step and the ratios (unfused / fused: above 1.0, fusion is faster).

    OMP_NUM_THREADS=1 python benchmarks/bench_wgrad_fusion.py --steps 5 model=llama_50m \\
        train.micro_batch_size=2 train.global_batch_size=8
"""

import argparse
import json
import os
import time

import torch

from megand.tools.benchmark_megand import benchmark_config
from megand.training.pretrain import Trainer


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for pretrain_gpt.py")
    p.add_argument("--steps", type=int, default=5, help="timed steps of each side (after one untimed)")
    args = p.parse_intermixed_args()
    cfg = benchmark_config(args.overrides, 2 * args.steps, 2, cuda=False)
    os.makedirs(cfg.run_dir, exist_ok=True)
    trainer = Trainer(cfg)
    params = [q for chunk in trainer.chunks for q in chunk.parameters() if hasattr(q, "accumulate_grad")]
    fused = {q: q.accumulate_grad for q in params}

    def use_fusion(on: bool):
        for q in params:
            if on:
                q.accumulate_grad = fused[q]
            elif hasattr(q, "accumulate_grad"):
                del q.accumulate_grad

    times = {"fused": [], "unfused": []}
    for i in range(args.steps + 1):
        for name in times:
            use_fusion(name == "fused")
            wall, cpu = time.perf_counter(), time.process_time()
            trainer.step()
            if i:  # the first step of each side is warm-up
                times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    use_fusion(True)
    best = {name: (min(t[0] for t in ts), min(t[1] for t in ts)) for name, ts in times.items()}
    print(json.dumps({
        "overrides": args.overrides, "steps": args.steps, "threads": torch.get_num_threads(),
        "fused_wall_s": best["fused"][0], "unfused_wall_s": best["unfused"][0],
        "fused_cpu_s": best["fused"][1], "unfused_cpu_s": best["unfused"][1],
        "wall_ratio": best["unfused"][0] / best["fused"][0], "cpu_ratio": best["unfused"][1] / best["fused"][1],
        "loadavg": open("/proc/loadavg").read().split()[:3],
    }), flush=True)


if __name__ == "__main__":
    main()
