"""megand against a plain transformers loop on the same shape and batch, one process, their steps
alternating (megand, transformers, megand, ...), so both see the same load drift. Prints one JSON line:
each side's best wall time and best process-CPU time per step, and the ratios (transformers / megand: above
1.0, megand is faster). On a shared machine the CPU-time ratio is the steadier one (time spent descheduled
is not counted); ``tools/benchmark.py --mode both --rounds N`` gives the wall-time ratio of whole rounds.

    OMP_NUM_THREADS=1 python benchmarks/bench_cpu_ratio.py --steps 5 model=llama_50m train.micro_batch_size=4
    OMP_NUM_THREADS=1 python benchmarks/bench_cpu_ratio.py --steps 5 model=llama_50m model.num_layers=6 \\
        model.hidden_size=384 model.ffn_hidden_size=1024 model.num_attention_heads=6 model.num_query_groups=2 \\
        model.vocab_size=8000 train.micro_batch_size=4
"""

import argparse
import json
import os
import time

import torch
from omegaconf import OmegaConf

from megand.models.hf import build_hf_model
from megand.tools.benchmark_megand import benchmark_config
from megand.training.pretrain import Trainer


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for pretrain_gpt.py")
    p.add_argument("--steps", type=int, default=5, help="timed steps of each side (after one untimed)")
    args = p.parse_intermixed_args()
    cfg = benchmark_config(args.overrides, args.steps, 1, cuda=False)
    os.makedirs(cfg.run_dir, exist_ok=True)
    trainer = Trainer(cfg)
    torch.manual_seed(cfg.train.seed)
    model = build_hf_model(OmegaConf.to_container(cfg.model, resolve=True), attn_implementation="sdpa")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    micro_batch, seq, vocab = cfg.train.micro_batch_size, cfg.model.seq_length, cfg.model.vocab_size

    def transformers_step():  # as benchmark_baseline's loop
        tokens = torch.randint(0, vocab, (micro_batch, seq))
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()

    times = {"megand": [], "transformers": []}
    for i in range(args.steps + 1):
        for name, step in (("megand", trainer.step), ("transformers", transformers_step)):
            wall, cpu = time.perf_counter(), time.process_time()
            step()
            if i:  # the first step of each side is warm-up
                times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    best = {name: (min(t[0] for t in ts), min(t[1] for t in ts)) for name, ts in times.items()}
    print(json.dumps({
        "overrides": args.overrides, "steps": args.steps, "threads": torch.get_num_threads(),
        "megand_wall_s": best["megand"][0], "transformers_wall_s": best["transformers"][0],
        "megand_cpu_s": best["megand"][1], "transformers_cpu_s": best["transformers"][1],
        "wall_ratio": best["transformers"][0] / best["megand"][0],
        "cpu_ratio": best["transformers"][1] / best["megand"][1],
        "loadavg": open("/proc/loadavg").read().split()[:3],
    }), flush=True)


if __name__ == "__main__":
    main()
