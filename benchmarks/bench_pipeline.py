"""Pipeline bubble: per stage, busy vs idle time of each schedule's step, next to the action-list
replay's prediction and the formula; per stage, the micro-batch chunks held at once next to the
memory estimator's count.

    python benchmarks/bench_pipeline.py --pp 2 --m 8 --schedules 1f1b interleaved zb1p zbv dualpipev [overrides ...]

Runs the training step of a config on ``pp`` local ranks (gloo, CPU; pipeline parallelism only) once
per schedule (``1f1b``, ``interleaved`` with ``--vpp`` chunks per rank, ``zb1p``, and ``zbv`` and
``dualpipev`` with two chunks per rank in a V: ``parallel.pp_schedule``).
Busy is the wall time a stage spends inside forward and backward computation; idle is the rest of the
schedule's wall time (waiting on its neighbours: the bubble, plus the p2p copies). Steps start
together (a barrier before each schedule, not timed).

Prediction: the planner's replay of the same action lists (megand/tools/planner/simulate.py) on the
stage times measured here (each stage's mean forward, backward, input- and weight-gradient pass).
Formula: 1F1B idles ``(p-1)/(m+p-1)`` of the step, interleaved 1F1B with v chunks ``(p-1)/(v·m+p-1)``,
ZB-H1 idles ``(p-1)(F+B-2W)`` per rank (F, B, W: a micro-batch's forward, whole backward and weight-
gradient times on a rank; ``(p-1)·F`` when B = 2W); for the V schedules the replay is the prediction.

Memory: the most micro-batch chunks whose activations a stage holds at once (forward run, backward
not complete; a split backward completes with its W), as the executor counted it, next to the count
the memory estimator (megand/tools/estimate_memory.py) reads from the same action list, and the
estimator's activation bytes for it.

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

from megand.core.pipeline_parallel.registry import DEFAULT_SCHEDULE, schedule_names, schedule_record

INTERLEAVED = "interleaved"  # the default schedule run with --vpp chunks per rank

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
        per_pass = {f"{kind}_s": seconds / len(args[1]) / len(args[0]) for kind, seconds in stats.kind_seconds.items()}
        records.append(dict(step_s=time.perf_counter() - start, busy_s=stats.compute_seconds, comm_s=stats.comm_seconds,
                            peak_live=stats.peak_live, **per_pass))
        return out

    trainer.schedule = timed_schedule
    for _ in range(warmup + steps):
        trainer.step()
    kept = records[warmup:]
    mean = {k: sum(r[k] for r in kept) / len(kept) for k in kept[0]}
    return dict(stage=trainer.topo.pp_rank, chunks=len(trainer.chunks), **mean)


def bench(pp, vpp, m, steps, warmup, extra, schedule=DEFAULT_SCHEDULE):
    from megand.tools.spawn import run_distributed
    from megand.training.config import compose

    run_dir = tempfile.mkdtemp(prefix="bench_pipeline_")
    overrides = [*DEFAULT_OVERRIDES, f"parallel.pp={pp}", f"parallel.vpp={vpp if vpp > 1 else 'null'}",
                 f"parallel.pp_schedule={schedule}", f"run_dir={run_dir}", *extra]
    cfg = compose(overrides)
    overrides.append(f"train.global_batch_size={m * cfg.train.micro_batch_size}")
    return run_distributed(_rank_main, pp, overrides, steps, warmup), compose(overrides)


def predicted(ranks, pp, vpp, m, schedule):
    """The replay of the schedule's action lists on the measured per-stage pass times: mean idle fraction."""
    from megand.tools.planner.simulate import simulate

    from megand.core.pipeline_parallel.actions import placement_for

    v = vpp if vpp > 1 else 1
    placement = placement_for(pp, v, schedule)
    forward, backward, weight = [0.0] * (pp * v), [0.0] * (pp * v), [0.0] * (pp * v)
    for r in ranks:  # a rank's chunks are timed together: every chunk of it gets the mean
        for c in range(v):
            s = placement.stage(r["stage"], c)
            forward[s] = r.get("F_s", 0.0)
            weight[s] = r.get("W_s", 0.0)
            backward[s] = r.get("B_s", 0.0) + r.get("I_s", 0.0) + weight[s]
    timeline = simulate(pp, vpp if vpp > 1 else None, m, forward, backward, schedule=schedule, weight_grad=weight)
    return [1.0 - b / timeline.makespan for b in timeline.busy]


def formula(pp, vpp, m, schedule, ranks):
    """The schedule's closed-form idle fraction on the measured mean pass times (its record's), or none."""
    record = schedule_record(schedule)
    if record.bubble is None:  # no closed form printed: the replay is the prediction
        return None, "none (the replay's)"
    f, i, w = (sum(r.get(key, 0.0) for r in ranks) / len(ranks) for key in ("F_s", "I_s", "W_s"))
    return record.bubble(pp, vpp if vpp > 1 else None, m, f, i, w)


def estimated_memory(cfg, pp):
    """Per stage: the estimator's held chunk count and its activation bytes for them."""
    from omegaconf import OmegaConf

    from megand.core.pipeline_parallel.actions import peak_live_chunks
    from megand.tools.estimate_memory import Layout, estimate_memory

    layout = Layout.from_config(cfg.parallel, cfg.train, cfg.optim, world_size=pp)
    model = OmegaConf.to_container(cfg.model, resolve=True)
    estimate = estimate_memory(model, layout, stages=range(pp))
    m = layout.num_microbatches
    return [(peak_live_chunks(pp, layout.vpp, m, s.stage, layout.pp_schedule),
             (s.layer_activation_bytes + s.extra_activation_bytes) / 2**20) for s in estimate.stages]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--m", type=int, default=8, help="micro-batches per step")
    names = [DEFAULT_SCHEDULE, INTERLEAVED, *[s for s in schedule_names() if s != DEFAULT_SCHEDULE]]
    parser.add_argument("--schedules", nargs="+", default=names, choices=names)
    parser.add_argument("--vpp", type=int, default=2, help="model chunks per rank of the interleaved schedule")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("overrides", nargs="*", help="hydra overrides on top of the bench model")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    p, m = args.pp, args.m
    print(f"pp={p} m={m}, {args.steps} timed steps after {args.warmup} warm-up; {os.cpu_count()} CPUs for {p} ranks")
    report = {}
    for name in args.schedules:
        schedule = DEFAULT_SCHEDULE if name == INTERLEAVED else name
        record = schedule_record(schedule)
        v = args.vpp if name == INTERLEAVED else record.chunks or 1
        ranks, cfg = bench(p, v, m, args.steps, args.warmup, args.overrides, schedule)
        ranks = sorted(ranks, key=lambda r: r["stage"])
        theory, written = formula(p, v, m, schedule, ranks)
        replay = predicted(ranks, p, v, m, schedule)
        memory = estimated_memory(cfg, p)
        step = max(r["step_s"] for r in ranks)
        title = (f"interleaved {record.title}, v={v}" if name == INTERLEAVED
                 else f"{record.title} ({name}{f', v={v}' if v > 1 else ''})")
        print(f"\n{title}: step {step * 1e3:.0f} ms, formula {written}" + ("" if theory is None else f" = {theory:.3f}"))
        print(" stage | busy ms | idle ms | idle fraction | replay | of which p2p ms | held chunks | estimator | est. act. MiB")
        fractions = []
        for r, predicted_idle, (count, mib) in zip(ranks, replay, memory):
            idle = r["step_s"] - r["busy_s"]
            fractions.append(idle / r["step_s"])
            print(f" {r['stage']:5d} | {r['busy_s'] * 1e3:7.0f} | {idle * 1e3:7.0f} | {fractions[-1]:13.3f} | "
                  f"{predicted_idle:6.3f} | {r['comm_s'] * 1e3:14.0f} | {r['peak_live']:11.0f} | {count:9d} | {mib:13.1f}")
        mean = sum(fractions) / len(fractions)
        print(f" mean idle fraction {mean:.3f}, replay {sum(replay) / len(replay):.3f}"
              + ("" if theory is None else f", formula {theory:.3f}"))
        report[name] = dict(step_ms=step * 1e3, idle_fraction=fractions, mean_idle_fraction=mean, theory=theory,
                            replay_idle_fraction=replay, estimated_chunks=[c for c, _ in memory],
                            estimated_activation_mib=[b for _, b in memory], ranks=ranks)
    if DEFAULT_SCHEDULE in report:
        for name in report:
            if name != DEFAULT_SCHEDULE:
                ratio = report[name]["step_ms"] / report[DEFAULT_SCHEDULE]["step_ms"]
                print(f"step time {name} / 1F1B: {ratio:.3f}")
                report[name]["step_ratio_vs_1f1b"] = ratio
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
