"""Training speed with ``train.compile=true`` against eager, one process, the two trainers alternating step
by step (so both see the same load drift), and what compilation made: dynamo's compiled frames and
graphs (every transformer layer should run one graph) and the layers' compile time. Prints one JSON line:
each side's best step time and tokens/s, the compiled/eager speed ratio, the frames and graphs, both
sides' losses (the same model and data: they should agree to rounding).

    OMP_NUM_THREADS=1 python benchmarks/bench_compile.py --steps 5 model=llama_tiny model.num_layers=12
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
    from torch._dynamo.utils import counters

    trainers = {}
    for name in ("eager", "compiled"):
        cfg = benchmark_config(args.overrides + [f"train.compile={name == 'compiled'}"], args.steps + 1, 1, cuda=False)
        cfg.run_dir = os.path.join(cfg.run_dir, name)
        os.makedirs(cfg.run_dir, exist_ok=True)
        trainers[name] = Trainer(cfg)
    counters.clear()
    times, losses = {name: [] for name in trainers}, {name: [] for name in trainers}
    for i in range(args.steps + 1):
        for name, trainer in trainers.items():
            start = time.perf_counter()
            loss, _ = trainer.step()
            if i:  # the first step of each side is warm-up (the compiled side compiles there)
                times[name].append(time.perf_counter() - start)
            losses[name].append(float(loss))
    t = trainers["eager"].cfg
    tokens = t.train.global_batch_size * t.model.seq_length
    best = {name: min(ts) for name, ts in times.items()}
    print(json.dumps({
        "overrides": args.overrides, "steps": args.steps, "threads": torch.get_num_threads(),
        "tokens_per_step": tokens,
        **{f"{name}_step_s": best[name] for name in best},
        **{f"{name}_tokens_per_s": tokens / best[name] for name in best},
        "compiled_over_eager_speed": best["eager"] / best["compiled"],
        "compile_s": trainers["compiled"].compile_timer.seconds,
        "compiled_frames": counters["frames"]["ok"], "graphs": counters["stats"]["unique_graphs"],
        "losses": losses, "loadavg": open("/proc/loadavg").read().split()[:3],
    }), flush=True)
    for trainer in trainers.values():
        trainer.close()


if __name__ == "__main__":
    main()
