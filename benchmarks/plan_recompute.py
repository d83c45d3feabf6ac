"""The planner's heterogeneous speed-up before and after per-stage recompute (``train.recompute_layers``)
and the pipeline schedules (``parallel.pp_schedule``).

    python benchmarks/plan_recompute.py --cluster examples/cluster_two_types.yaml [overrides ...]

For the model and batch of the overrides (default: Llama 70B at 8k tokens with tp=8, sequence
parallelism, cp=1 and micro-batch 1 pinned) on a cluster of several groups, the planner is run three
times: ``uniform``: 1F1B only, ``train.recompute_layers=null`` pinned (every layer applies the one
recompute choice: the search before per-stage recompute); ``per_stage``: 1F1B only, each stage's
recomputed layers searched; ``schedules``: per-stage recompute and every pipeline schedule (1f1b,
interleaved with vpp, zb1p, zbv, dualpipev), ``parallel.vpp`` left to the search (a ``parallel.vpp=null``
given is dropped: it would rule out interleaving and the V's two chunks per rank). Each prints every
group's best homogeneous plan, the best heterogeneous plan and the speed-up ratio: heterogeneous
throughput over the sum of each group's best homogeneous throughput in the same search (a group that
cannot hold the model alone counts 0). Predictions only: no training runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT = ["model=llama_70b", "model.seq_length=8192", "train.global_batch_size=64", "parallel.tp=8",
           "parallel.sequence_parallel=true", "parallel.cp=1", "parallel.vpp=null", "train.micro_batch_size=1"]


SEARCHES = (  # label, extra overrides, schedules searched (None: all), whether vpp is searched
    ("uniform", ["train.recompute_layers=null"], ("1f1b",), False),
    ("per_stage", [], ("1f1b",), False),
    ("schedules", [], None, True),
)


def speedups(overrides, cluster_file) -> dict:
    """{label: figures} for each of :data:`SEARCHES` (hetero.speedup's figures)."""
    from megand.tools.plan import pinned_keys
    from megand.tools.planner.cluster import load_cluster
    from megand.tools.planner.hetero import speedup
    from megand.tools.planner.search import Planner, config_validator
    from megand.training.config import compose

    cluster = load_cluster(cluster_file)
    out = {}
    for label, extra, schedules, search_vpp in SEARCHES:
        run = [o for o in overrides if not (search_vpp and o.replace(" ", "") == "parallel.vpp=null")] + extra
        cfg = compose(run)
        out[label] = speedup(Planner(cfg, pinned_keys(run), cluster, validate_fn=config_validator(cfg),
                                     schedules=schedules))
    return out


def describe(plan) -> str:
    if plan is None:
        return "does not fit"
    c = plan.candidate
    layers = f" layers {list(c.pipeline_layout)}" if c.pipeline_layout else ""
    schedule = f" {c.pp_schedule}" + (f" vpp={c.vpp}" if c.vpp else "") if c.pp > 1 else ""
    counts = f" recompute_layers {list(c.recompute_layers)}" if c.recompute_layers is not None else ""
    return (f"{plan.prediction.tokens_per_s:,.0f} tokens/s (tp={c.tp} pp={c.pp}{schedule} dp={c.dp} "
            f"mbs={c.micro_batch_size} {c.sharding} recompute={c.recompute}{counts}{layers}, "
            f"bubble {plan.prediction.bubble_fraction:.1%}, peak GiB per stage "
            f"{'/'.join(f'{m:.1f}' for m in plan.prediction.mem_peak_gib)})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides (default: the 70B example above)")
    p.add_argument("--cluster", required=True, help="a cluster file of several groups (tools/plan.py's format)")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    figures = speedups(args.overrides or DEFAULT, args.cluster)
    for label, f in figures.items():
        print(f"{label}:")
        for name, plan in f["homogeneous_plans"].items():
            print(f"  {name} alone: {describe(plan)}")
        stages = " ".join(g.name for g in f["plan"].stage_groups) if f["plan"] else ""
        print(f"  heterogeneous: {describe(f['plan'])} on {stages}")
        print(f"  speed-up ratio: {f['ratio']:.3f}" if f["ratio"] is not None else "  speed-up ratio: none")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({k: {"ratio": f["ratio"], "tokens_per_s": f["tokens_per_s"],
                           "homogeneous_tokens_per_s": f["homogeneous_tokens_per_s"]} for k, f in figures.items()},
                      fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
