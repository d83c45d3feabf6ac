"""Measure checkpoint save/load: training stall per save (sync vs async), time until the checkpoint is
published, load time, on-disk size. Launch with torchrun (the layout comes from the overrides):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node=4 benchmarks/bench_checkpoint.py \
        --dir /tmp/bench_ckpt model=llama_50m parallel.tp=2 train.global_batch_size=4 train.micro_batch_size=1

Trains one step (so the Adam states exist), then for sync and async: `--repeats` saves, each timed
from the call to its return (the stall) and to the checkpoint being published (`latest` replaced);
for async it also times the training steps run while the write goes on in the background, against
the steps without. Then loads the last checkpoint into the same model (validation, checksums, read).
Prints one JSON line (rank 0).
"""

import argparse
import json
import os
import shutil
import subprocess
import time


import torch.distributed as dist
from omegaconf import OmegaConf

from megand.core.checkpointing import CheckpointConfig, Checkpointer
from megand.training.config import compose
from megand.training.pretrain import Trainer


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="scratch directory (deleted at the end unless --keep)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--keep", action="store_true")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    cfg = compose([f"run_dir={args.dir}/run", "train.iters=1000", "train.eval_iters=0", *args.overrides])
    os.makedirs(cfg.run_dir, exist_ok=True)
    trainer = Trainer(cfg)
    rank0 = dist.get_rank() == 0
    step_times = []

    def step():
        t = time.perf_counter()
        trainer.step()
        step_times.append(time.perf_counter() - t)
        return step_times[-1]

    step()
    n_params = sum(p.numel() for n, p in trainer.named_params if p.meta.copy_of is None and
                   (p.meta.split_dim is not None or p.meta.tp_rank == 0))
    import torch

    n_params = torch.tensor(n_params)
    dist.all_reduce(n_params, group=trainer.topo.mp_group)
    results = {"world_size": dist.get_world_size(), "layout": trainer.topo.describe().split(" ", 2)[2],
               "params": int(n_params)}
    for mode in ("sync", "async"):
        ckpt = Checkpointer(CheckpointConfig(save=f"{args.dir}/{mode}", async_save=mode == "async"), trainer.topo, trainer.named_params, trainer.optimizer, trainer.chunks,
                            OmegaConf.to_yaml(cfg), OmegaConf.to_container(cfg.model))
        stalls, published, during, baseline = [], [], [], []
        for _ in range(args.repeats):
            baseline.append(step())
            dist.barrier()
            t = time.perf_counter()
            ckpt.save(trainer.iteration, trainer.iteration * cfg.train.global_batch_size)
            stalls.append(time.perf_counter() - t)
            if mode == "async":  # train while the write goes on
                while ckpt.pending is not None and not ckpt.pending.done():
                    during.append(step())
                ckpt.wait()
            dist.barrier()
            published.append(time.perf_counter() - t)
        ckpt.close()
        r = {"stall_s": [round(s, 3) for s in stalls], "published_s": [round(s, 3) for s in published]}
        if mode == "async":
            r["steps_during_write"] = len(during)
            r["step_s_during_write"] = round(sum(during) / max(1, len(during)), 3)
            r["step_s_without"] = round(sum(baseline) / len(baseline), 3)
        results[mode] = r
    last = f"{args.dir}/async"
    dist.barrier()
    t = time.perf_counter()
    ckpt.load(last)
    dist.barrier()
    results["load_s"] = round(time.perf_counter() - t, 3)
    if rank0:
        it = open(f"{last}/latest").read().strip()
        size = subprocess.run(["du", "-sb", f"{last}/iter_{int(it):07d}"], capture_output=True, text=True).stdout.split()[0]
        results["size_bytes"] = int(size)
        results["size_mib"] = round(int(size) / 2**20, 1)
        print(json.dumps(results), flush=True)
    dist.barrier()
    if rank0 and not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
