"""What a user sees: ``pretrain_gpt.py`` end to end (tokens/s from its ``metrics.jsonl``), eager and under
``train.compile=true``, against a plain transformers training loop on the same LLaMA shape and batch, one
process, fp32. Each run is a process of its own; the three alternate, ``--rounds`` times, so the machine's
load drift reaches all of them alike. Prints one JSON line: each side's median tokens/s per round (steps
after ``--warmup``), the best round of each, and the ratios over transformers.

    OMP_NUM_THREADS=1 python benchmarks/bench_e2e.py --iters 8 --warmup 3 --rounds 2 model=llama_50m \\
        train.micro_batch_size=4
    OMP_NUM_THREADS=1 python benchmarks/bench_e2e.py --profile model=llama_50m train.micro_batch_size=4

``--profile``: instead, one step of megand's Trainer and one of the transformers loop under
``torch.profiler``, the operators that take the most CPU time side by side.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def megand_run(overrides, iters, warmup, compile_, run_dir) -> float:
    """Median tokens/s of ``pretrain_gpt.py``'s logged iterations after ``warmup``."""
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *overrides, f"train.iters={iters}",
           "train.log_interval=1", "train.eval_iters=0", "train.eval_interval=1000000", f"run_dir={run_dir}",
           f"train.compile={'true' if compile_ else 'false'}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r and r["iter"] > warmup]
    return statistics.median(rates)


TRANSFORMERS_LOOP = r"""
import json, sys, time, torch
from megand.models.hf import build_hf_model
from megand.tools.benchmark_megand import benchmark_config
from omegaconf import OmegaConf
overrides, iters, warmup = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
cfg = benchmark_config(overrides, iters, 0, cuda=False)
torch.manual_seed(cfg.train.seed)
model = build_hf_model(OmegaConf.to_container(cfg.model, resolve=True), attn_implementation="sdpa")
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
batch, seq, vocab = cfg.train.global_batch_size, cfg.model.seq_length, cfg.model.vocab_size
rates = []
for i in range(iters):
    start = time.perf_counter()
    tokens = torch.randint(0, vocab, (batch, seq))
    opt.zero_grad(set_to_none=True)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    opt.step()
    loss.item()
    if i >= warmup:
        rates.append(batch * seq / (time.perf_counter() - start))
print(json.dumps(sorted(rates)[len(rates) // 2]))
"""


def transformers_run(overrides, iters, warmup) -> float:
    out = subprocess.run([sys.executable, "-c", TRANSFORMERS_LOOP, json.dumps(overrides), str(iters), str(warmup)],
                         check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def profile(overrides, top: int = 15) -> None:
    import torch
    from omegaconf import OmegaConf
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from megand.models.hf import build_hf_model
    from megand.tools.benchmark_megand import benchmark_config
    from megand.training.pretrain import Trainer

    cfg = benchmark_config(overrides, 2, 0, cuda=False)
    os.makedirs(cfg.run_dir, exist_ok=True)
    trainer = Trainer(cfg)
    model = build_hf_model(OmegaConf.to_container(cfg.model, resolve=True), attn_implementation="sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    batch, seq, vocab = cfg.train.global_batch_size, cfg.model.seq_length, cfg.model.vocab_size

    def hf_step():
        tokens = torch.randint(0, vocab, (batch, seq))
        opt.zero_grad(set_to_none=True)
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()

    for name, step in (("megand", trainer.step), ("transformers", hf_step)):
        step()  # warm-up
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        print(f"== {name}: one step")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))
    trainer.close()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for pretrain_gpt.py")
    p.add_argument("--iters", type=int, default=8, help="iterations of each run")
    p.add_argument("--warmup", type=int, default=3, help="first iterations left out of the median")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--profile", action="store_true", help="profile one step of each side instead")
    args = p.parse_intermixed_args()
    overrides = list(args.overrides)
    if not any(o.startswith("train.global_batch_size=") for o in overrides):  # one micro-batch per step
        micro = [o.split("=", 1)[1] for o in overrides if o.startswith("train.micro_batch_size=")]
        overrides.append(f"train.global_batch_size={micro[-1] if micro else 1}")
    if args.profile:
        return profile(overrides)
    results = {"megand": [], "megand_compiled": [], "transformers": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            results["megand"].append(megand_run(overrides, args.iters, args.warmup, False, f"{tmp}/e{r}"))
            results["megand_compiled"].append(megand_run(overrides, args.iters, args.warmup, True, f"{tmp}/c{r}"))
            results["transformers"].append(transformers_run(overrides, args.iters, args.warmup))
    best = {k: max(v) for k, v in results.items()}
    print(json.dumps({
        "overrides": overrides, "iters": args.iters, "warmup": args.warmup, "tokens_per_s": results,
        "best": best, "eager_ratio": best["megand"] / best["transformers"],
        "compiled_ratio": best["megand_compiled"] / best["transformers"],
        "loadavg": open("/proc/loadavg").read().split()[:3], "time": time.strftime("%H:%M:%S")}))


if __name__ == "__main__":
    main()
