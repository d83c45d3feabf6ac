"""Pipeline bubble: per stage, busy vs idle time of each step's schedule, next to the theory.

    python benchmarks/bench_pipeline.py --pp 4 --m 8 --vpp 1 2 [hydra overrides ...]

Runs the training step of a config on ``pp`` local ranks (gloo, CPU; pipeline parallelism only) once
per ``--vpp`` value. Busy is the wall time a stage spends inside forward and backward computation; idle
is the rest of the schedule's wall time (waiting on its neighbours: the bubble, plus the p2p copies).
Steps start together (a barrier before each schedule, not timed). Theory: 1F1B idles ``(p-1)/(m+p-1)``
of the step, interleaved 1F1B with v chunks ``(p-1)/(v·m+p-1)``.

The default model (8 layers, hidden 512, seq 256, vocab 256) makes a layer's forward+backward of one
micro-batch cost tens of ms, far above the p2p and Python overhead, so timings mean something. On a
machine with fewer cores than ranks, stages that compute at the same time share cores, which stretches
busy time in the steady state more than in the bubble; the tool prints the CPU count so a reader can tell.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULT_OVERRIDES = [
    "+experiment=tiny_gpt", "model.num_layers=8", "model.hidden_size=512", "model.ffn_hidden_size=2048",
    "model.num_attention_heads=8", "model.seq_length=256", "model.vocab_size=256", "train.micro_batch_size=1",
    "train.eval_iters=0",
]


def _rank_main(overrides, steps, warmup):
    import torch.distributed as dist

    from megand.core.pipeline_parallel import ScheduleStats
    from megand.training.config import compose
    from megand.training.pretrain import Trainer

    trainer = Trainer(compose(overrides))
    schedule, records = trainer.schedule, []

    def timed_schedule(*args, **kwargs):
        dist.barrier(group=trainer.topo.pp_group)
        stats, start = ScheduleStats(), time.perf_counter()
        out = schedule(*args, stats=stats, **kwargs)
        records.append(dict(step_s=time.perf_counter() - start, busy_s=stats.compute_seconds, comm_s=stats.comm_seconds))
        return out

    trainer.schedule = timed_schedule
    for _ in range(warmup + steps):
        trainer.step()
    kept = records[warmup:]
    mean = {k: sum(r[k] for r in kept) / len(kept) for k in kept[0]}
    return dict(stage=trainer.topo.pp_rank, chunks=len(trainer.chunks), **mean)


def bench(pp, vpp, m, steps, warmup, extra):
    from megand.tools.spawn import run_distributed
    from megand.training.config import compose

    run_dir = tempfile.mkdtemp(prefix="bench_pipeline_")
    overrides = [*DEFAULT_OVERRIDES, f"parallel.pp={pp}", f"parallel.vpp={vpp if vpp > 1 else 'null'}",
                 f"run_dir={run_dir}", *extra]
    mbs = compose(overrides).train.micro_batch_size
    overrides.append(f"train.global_batch_size={m * mbs}")
    return run_distributed(_rank_main, pp, overrides, steps, warmup)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--m", type=int, default=8, help="micro-batches per step")
    parser.add_argument("--vpp", type=int, nargs="+", default=[1, 2], help="model chunks per rank (1: 1F1B)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("overrides", nargs="*", help="hydra overrides on top of the bench model")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    p, m = args.pp, args.m
    print(f"pp={p} m={m}, {args.steps} timed steps after {args.warmup} warm-up; {os.cpu_count()} CPUs for {p} ranks")
    report = {}
    for v in args.vpp:
        ranks = bench(p, v, m, args.steps, args.warmup, args.overrides)
        theory = (p - 1) / (v * m + p - 1)
        step = max(r["step_s"] for r in ranks)
        name = "1F1B" if v == 1 else f"interleaved 1F1B, v={v}"
        print(f"\n{name}: step {step * 1e3:.0f} ms, theoretical bubble (p-1)/({'v·' if v > 1 else ''}m+p-1) = {theory:.3f}")
        print(" stage | busy ms | idle ms | idle fraction | of which p2p ms")
        fractions = []
        for r in ranks:
            idle = r["step_s"] - r["busy_s"]
            fractions.append(idle / r["step_s"])
            print(f" {r['stage']:5d} | {r['busy_s'] * 1e3:7.0f} | {idle * 1e3:7.0f} | {fractions[-1]:13.3f} | {r['comm_s'] * 1e3:7.0f}")
        mean = sum(fractions) / len(fractions)
        print(f" mean idle fraction {mean:.3f} vs theory {theory:.3f}")
        report[v] = dict(step_ms=step * 1e3, idle_fraction=fractions, mean_idle_fraction=mean, theory=theory, ranks=ranks)
    if 1 in report and len(report) > 1:
        for v in report:
            if v > 1:
                ratio = report[v]["step_ms"] / report[1]["step_ms"]
                ideal = (m + (p - 1) / v) / (m + p - 1)
                print(f"\nstep time interleaved (v={v}) / 1F1B: {ratio:.3f} (ideal, compute only: {ideal:.3f})")
                report[v]["step_ratio_vs_1f1b"] = ratio
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
