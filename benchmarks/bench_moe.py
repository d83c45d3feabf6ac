"""Expert parallelism on CPU: moe_tiny tokens/s at ep=1, 2, 4, the all-to-all bytes per step against
theory, and the load balance after 200 steps with and without balancing.

    OMP_NUM_THREADS=1 python benchmarks/bench_moe.py --dir /tmp/bench_moe [--world 4] [--steps 20] [--balance-steps 200]

Throughput: ``--world`` spawned gloo ranks, all data parallel (dp = world), ep = 1, 2, 4 (<= world):
the same model, data and global batch, only the expert placement changes. Per rank and step the
dispatcher counts the token bytes it sends to other ranks (dispatch and combine, forward and backward).
Theory per rank and step, for routing spread evenly over the experts:

    tokens x k x hidden x dtype bytes x (ep-1)/ep x 2 (dispatch, combine) x 2 (forward, backward) x MoE layers

with tokens = global batch x seq / dp (the tokens a rank routes). Load balance: one process, 200 steps of
moe_tiny on the offline quickstart corpus, ``expert_load_max_over_mean`` (max over MoE layers of the
most loaded expert's assignments over the mean, over the step) at the last step and averaged over the
last 20: softmax router without / with the aux loss, sigmoid router without / with the aux-free bias.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["+experiment=tiny_llama", "model=moe_tiny", "train.eval_iters=0", "train.log_interval=1000"]


def _throughput(run_dir, ep, gbs, steps):
    import torch.distributed as dist

    from megand.core.transformer.moe import moe_layers
    from megand.training.config import compose
    from megand.training.pretrain import Trainer

    world = dist.get_world_size()
    cfg = compose([*MODEL, f"run_dir={run_dir}/ep{ep}", f"parallel.ep={ep}", f"train.iters={steps + 2}",
                   f"train.global_batch_size={gbs}", f"train.micro_batch_size={gbs // world}"])
    trainer = Trainer(cfg)
    layers = moe_layers(trainer.chunks)
    trainer.step()  # warm-up
    sent0 = sum(getattr(m.dispatcher, "bytes_sent", 0) for m in layers)
    dist.barrier()
    t = time.perf_counter()
    for _ in range(steps):
        trainer.step()
    dist.barrier()
    elapsed = time.perf_counter() - t
    sent = (sum(getattr(m.dispatcher, "bytes_sent", 0) for m in layers) - sent0) / steps
    m = cfg.model
    tokens = gbs * m.seq_length // world
    theory = tokens * m.moe_top_k * m.hidden_size * 4 * (ep - 1) / ep * 2 * 2 * len(layers)
    return {"ep": ep, "tokens_per_s": gbs * m.seq_length * steps / elapsed, "a2a_bytes_per_step": sent,
            "a2a_bytes_theory": theory}


def _balance(run_dir, cache, name, overrides, steps):
    out = os.path.join(run_dir, name)
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *MODEL, f"run_dir={out}", "data=quickstart",
           f"data.cache_dir={cache}", "model.vocab_size=2048", f"train.iters={steps}", "train.log_interval=1",
           "train.global_batch_size=8", "train.micro_batch_size=8", f"optim.decay_iters={steps}", *overrides]
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "expert_load_max_over_mean" in r]
    last = rows[-20:]
    return {"last": rows[-1]["expert_load_max_over_mean"],
            "mean_last_20": sum(r["expert_load_max_over_mean"] for r in last) / len(last),
            "loss": rows[-1]["loss"]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="scratch directory for the runs")
    p.add_argument("--world", type=int, default=4, help="ranks of the throughput runs (dp = world)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per throughput run")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--balance-steps", type=int, default=200, help="0: skip the load-balance runs")
    args = p.parse_args()
    sys.path.insert(0, ROOT)
    from megand.tools.spawn import run_distributed

    result = {"world": args.world, "global_batch": args.global_batch, "throughput": []}
    for ep in (e for e in (1, 2, 4) if e <= args.world and args.world % e == 0):
        per_rank = run_distributed(_throughput, args.world, args.dir, ep, args.global_batch, args.steps)
        row = dict(per_rank[0])
        row["a2a_bytes_per_step"] = sum(r["a2a_bytes_per_step"] for r in per_rank) / len(per_rank)  # mean over ranks
        row["a2a_measured_over_theory"] = (row["a2a_bytes_per_step"] / row["a2a_bytes_theory"]
                                           if row["a2a_bytes_theory"] else None)
        result["throughput"].append(row)
    if args.balance_steps:
        cache = os.path.join(args.dir, "data_cache")
        runs = {
            "softmax_no_aux": ["model.moe_aux_loss_coeff=0"],
            "softmax_aux_0.01": ["model.moe_aux_loss_coeff=0.01"],
            "sigmoid_no_bias": ["model.moe_router=sigmoid", "model.moe_aux_loss_coeff=0", "model.moe_bias_update_rate=0"],
            "sigmoid_aux_free_bias_0.001": ["model.moe_router=sigmoid", "model.moe_aux_loss_coeff=0",
                                            "model.moe_bias_update_rate=0.001"],
        }
        result["load_balance"] = {name: _balance(args.dir, cache, name, o, args.balance_steps) for name, o in runs.items()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
