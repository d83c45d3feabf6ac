"""What a user sees: ``pretrain_gpt.py`` end to end (tokens/s from its ``metrics.jsonl``), eager and under
``train.compile=true``, against a plain transformers training loop on the same LLaMA shape and batch, one
process, fp32. Each run is a process of its own; the three alternate, ``--rounds`` times, so the machine's
load drift reaches all of them alike. Prints one JSON line: each side's median tokens/s per round (steps
after ``--warmup``), the best round of each, and the ratios over transformers; then the two ratio lines.

The transformers loop trains with the run's recipe where a plain loop has it: AdamW with the config's
betas, weight decay and learning rate, and gradient clipping at ``optim.clip_grad`` (as megand, and as
transformers' Trainer by default: ``max_grad_norm=1.0``); ``--no-baseline-clip`` leaves the clipping out.
megand's runs ask torch's CPU allocator for huge pages, as ``pretrain_gpt.py`` does (``megand.prefer_huge_pages``);
the plain loop does not, unless ``--baseline-thp`` (the same setting for both sides).

    OMP_NUM_THREADS=1 python benchmarks/bench_e2e.py --iters 8 --warmup 3 --rounds 2 model=llama_50m \\
        train.micro_batch_size=4
    OMP_NUM_THREADS=1 python benchmarks/bench_e2e.py --profile model=llama_50m train.micro_batch_size=4

``--gemms``: instead, every matrix product of two steps of megand's eager Trainer and of the transformers loop,
each side in a process of its own: per product and operand layout, calls, GFLOP, CPU time and GFLOP/s.

``--profile``: instead, one step of megand's Trainer (eager and compiled) and one of the transformers loop
under ``torch.profiler``, each in a process of its own, the operators that take the most CPU time side by
side, with each one's user and system CPU time.
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
clip = cfg.optim.clip_grad if sys.argv[4] == "1" else 0.0
torch.manual_seed(cfg.train.seed)
model = build_hf_model(OmegaConf.to_container(cfg.model, resolve=True), attn_implementation="sdpa")
model.train()
o = cfg.optim
opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
batch, seq, vocab = cfg.train.global_batch_size, cfg.model.seq_length, cfg.model.vocab_size
rates = []
for i in range(iters):
    start = time.perf_counter()
    tokens = torch.randint(0, vocab, (batch, seq))
    opt.zero_grad(set_to_none=True)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    loss.item()
    if i >= warmup:
        rates.append(batch * seq / (time.perf_counter() - start))
print(json.dumps(sorted(rates)[len(rates) // 2]))
"""


def transformers_run(overrides, iters, warmup, clip: bool, thp: bool) -> float:
    """Median tokens/s of the transformers loop after ``warmup``; ``clip``: at the config's ``optim.clip_grad``;
    ``thp``: with torch's huge pages for large CPU tensors, as megand's runs."""
    out = subprocess.run([sys.executable, "-c", TRANSFORMERS_LOOP, json.dumps(overrides), str(iters), str(warmup),
                          "1" if clip else "0"],
                         check=True, capture_output=True, text=True, cwd=ROOT, env=_side_env("transformers", thp))
    return json.loads(out.stdout.strip().splitlines()[-1])


PROFILED = ("megand", "megand_compiled", "transformers")  # the sides of --profile, each in a process of its own


def make_step(side, overrides, clip: bool):
    """One training step of ``side`` in this process, as a function: megand's ``Trainer.iterate`` (eager or
    compiled) or the transformers loop's body."""
    import torch
    from omegaconf import OmegaConf

    from megand.tools.benchmark_megand import benchmark_config

    cfg = benchmark_config(overrides, 3, 0, cuda=False)
    if side == "transformers":
        from megand.models.hf import build_hf_model

        torch.manual_seed(cfg.train.seed)
        model = build_hf_model(OmegaConf.to_container(cfg.model, resolve=True), attn_implementation="sdpa")
        model.train()
        o = cfg.optim
        opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                weight_decay=o.weight_decay)
        batch, seq, vocab = cfg.train.global_batch_size, cfg.model.seq_length, cfg.model.vocab_size

        def step():
            tokens = torch.randint(0, vocab, (batch, seq))
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            if clip and o.clip_grad > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad)
            opt.step()
            loss.item()
        return step
    from megand.training.pretrain import Trainer

    cfg.train.compile = side == "megand_compiled"
    os.makedirs(cfg.run_dir, exist_ok=True)
    return Trainer(cfg).iterate  # the step and its log line, as pretrain_gpt.py runs it


def profile_side(side, overrides, clip: bool) -> dict:
    """One step of ``side`` (after two) under ``torch.profiler``, in this process: its user and system CPU time
    and each operator's self time (ms) and calls."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    step = make_step(side, overrides, clip)
    step()  # warm-up (and compilation)
    step()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        start = os.times()
        step()
        end = os.times()
    return {"user": end.user - start.user, "system": end.system - start.system,
            "ops": {e.key: (e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()}}


def gemms_side(side, overrides, clip: bool, steps: int = 2) -> dict:
    """Each matrix product of ``steps`` steps of ``side`` (after two), in this process, timed in the thread's
    CPU time (less sensitive to a loaded machine than wall time): per operator and operand layout, its
    calls, GFLOP and seconds per step. An operand is written ``[rows, cols]``, with ``T`` when it is a
    transposed view (column-major) and ``s`` when neither layout is dense."""
    import time

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    operands = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2), aten.addmm_.default: (1, 2),
                aten.bmm.default: (0, 1), aten.baddbmm.default: (1, 2)}

    def layout(t):
        dense = t.is_contiguous()
        transposed = t.dim() == 2 and t.stride(0) == 1 and t.stride(1) >= t.shape[0]
        return f"{list(t.shape)}{'T' if transposed else '' if dense else 's'}"

    table = {}

    class Timer(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            start = time.thread_time()
            out = func(*args, **(kwargs or {}))
            if func in operands:
                a, b = (args[i] for i in operands[func])
                flops = 2 * a.numel() * b.shape[-1]
                row = table.setdefault(f"{func.__name__.split('.')[0]} {layout(a)} x {layout(b)}", [0, 0.0, 0.0])
                row[0] += 1
                row[1] += flops / 1e9
                row[2] += time.thread_time() - start
            return out

    step = make_step(side, overrides, clip)
    step()  # warm-up (and compilation)
    step()
    with Timer():
        for _ in range(steps):
            step()
    return {k: (n // steps, gflop / steps, t / steps) for k, (n, gflop, t) in table.items()}


def gemms(overrides, clip: bool, thp: bool) -> None:
    """The products of megand's eager step and the transformers step, each side in a process of its own."""
    for side in ("megand", "transformers"):
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--gemms-side", side, *overrides,
                              *([] if clip else ["--no-baseline-clip"])],
                             check=True, capture_output=True, text=True, cwd=ROOT, env=_side_env(side, thp))
        rows = json.loads(out.stdout.strip().splitlines()[-1])
        gflop, seconds = sum(r[1] for r in rows.values()), sum(r[2] for r in rows.values())
        print(f"{side}: products {seconds:.3f} s CPU per step, {gflop:.1f} GFLOP, {gflop / seconds:.1f} GFLOP/s")
        print(f"  {'product (operands)':58s} {'calls':>5s} {'GFLOP':>7s} {'ms':>8s} {'GFLOP/s':>8s}")
        for key, (n, g, t) in sorted(rows.items(), key=lambda kv: -kv[1][2]):
            print(f"  {key:58s} {n:5d} {g:7.2f} {t * 1e3:8.1f} {g / t:8.1f}")


def _side_env(side: str, thp: bool) -> dict:
    """The environment of a child process running ``side`` with megand from this tree: huge pages for torch's
    large CPU tensors on megand's sides, as ``pretrain_gpt.py`` asks for them, and on the transformers loop's
    only with ``thp`` (a setting of the caller's own wins on every side)."""
    from megand import HUGE_PAGES

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    return {**HUGE_PAGES, **env} if side != "transformers" or thp else env


def profile(overrides, clip: bool, thp: bool, top: int = 30) -> None:
    """Each side profiled in a process of its own (in one process the second side's step runs on the first
    one's heap, which changes its page faults and its time), then their operators side by side."""
    got = {}
    for side in PROFILED:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--profile-side", side, *overrides,
                              *([] if clip else ["--no-baseline-clip"])],
                             check=True, capture_output=True, text=True, cwd=ROOT, env=_side_env(side, thp))
        got[side] = json.loads(out.stdout.strip().splitlines()[-1])
    # the process's CPU time (user + system: page faults of fresh allocations are system time) and each
    # operator's self time, side by side, the largest first
    for side, g in got.items():
        print(f"{side:16s} cpu {g['user'] + g['system']:.3f} s (user {g['user']:.3f}, system {g['system']:.3f}); "
              f"operators' self time {sum(t for t, _ in g['ops'].values()) / 1e3:.3f} s")
    keys = sorted(set().union(*(g["ops"] for g in got.values())),
                  key=lambda k: -max(g["ops"].get(k, (0, 0))[0] for g in got.values()))
    print(f"{'operator':48s}" + "".join(f" {side + ' ms':>22s}" for side in got))
    for k in keys[:top]:
        cells = [g["ops"].get(k, (0.0, 0)) for g in got.values()]
        print(f"{k[:48]:48s}" + "".join(f" {t:15.1f} ({n:4d})" for t, n in cells))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for pretrain_gpt.py")
    p.add_argument("--iters", type=int, default=8, help="iterations of each run")
    p.add_argument("--warmup", type=int, default=3, help="first iterations left out of the median")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--profile", action="store_true", help="profile one step of each side instead")
    p.add_argument("--profile-side", choices=PROFILED, help=argparse.SUPPRESS)  # one side of --profile
    p.add_argument("--gemms", action="store_true",
                   help="instead, each matrix product of megand's eager step and the transformers step: "
                        "operand layouts, GFLOP, CPU time and GFLOP/s")
    p.add_argument("--gemms-side", choices=PROFILED, help=argparse.SUPPRESS)  # one side of --gemms
    p.add_argument("--baseline-thp", action="store_true",
                   help="the transformers loop with huge pages for torch's large CPU tensors too, as megand's runs")
    p.add_argument("--no-baseline-clip", dest="clip", action="store_false",
                   help="the transformers loop without gradient clipping (megand clips at optim.clip_grad)")
    args = p.parse_intermixed_args()
    overrides = list(args.overrides)
    if not any(o.startswith("train.global_batch_size=") for o in overrides):  # one micro-batch per step
        micro = [o.split("=", 1)[1] for o in overrides if o.startswith("train.micro_batch_size=")]
        overrides.append(f"train.global_batch_size={micro[-1] if micro else 1}")
    if args.profile_side:
        return print(json.dumps(profile_side(args.profile_side, overrides, args.clip)))
    if args.profile:
        return profile(overrides, args.clip, args.baseline_thp)
    if args.gemms_side:
        return print(json.dumps(gemms_side(args.gemms_side, overrides, args.clip)))
    if args.gemms:
        return gemms(overrides, args.clip, args.baseline_thp)
    results = {"megand": [], "megand_compiled": [], "transformers": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            results["megand"].append(megand_run(overrides, args.iters, args.warmup, False, f"{tmp}/e{r}"))
            results["megand_compiled"].append(megand_run(overrides, args.iters, args.warmup, True, f"{tmp}/c{r}"))
            results["transformers"].append(transformers_run(overrides, args.iters, args.warmup, args.clip,
                                                            args.baseline_thp))
    best = {k: max(v) for k, v in results.items()}
    eager, compiled = best["megand"] / best["transformers"], best["megand_compiled"] / best["transformers"]
    print(json.dumps({
        "overrides": overrides, "iters": args.iters, "warmup": args.warmup, "baseline_clip": args.clip,
        "baseline_thp": args.baseline_thp,
        "tokens_per_s": results, "best": best, "eager_ratio": eager, "compiled_ratio": compiled,
        "loadavg": open("/proc/loadavg").read().split()[:3], "time": time.strftime("%H:%M:%S")}))
    print(f"eager    megand / transformers tokens/s: {eager:.3f}  (target >= 1.0)")
    print(f"compiled megand / transformers tokens/s: {compiled:.3f}  (target >= 1.2)")


if __name__ == "__main__":
    main()
