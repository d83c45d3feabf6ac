"""The planner's predicted step time against measured steps, on this machine at world size 2.

    python tools/calibrate.py --nproc 2 --output cpu.json          # first: this machine's profile
    python benchmarks/plan_accuracy.py --profile cpu.json [--rounds 2] [--json out.json]

For each layout of LAYOUTS (tp, tp+sp, pp, pp+vpp, cp, dp, every optim.sharding level, recompute,
micro-batch variants) of the CPU-sized model MODEL, ``pretrain_gpt.py`` runs on 2 local ranks (one per
core, OMP_NUM_THREADS=1); its step time is the median ``iter_time_ms`` of the steps after the third,
and the layout's figure is the median over ``--rounds`` rounds (the order reversed every other round,
so a slow period of a shared machine does not hit the same layouts each time). The prediction is the
planner's cost model (megand.tools.planner.cost.predict) for the same overrides on a one-node,
2-device cluster of the profile. Then the planner searches the layouts itself (model, batch and world
pinned); its top plan is run too (if not already in the list).

Printed: a table (measured, predicted, error), the median absolute error, Spearman's rank correlation,
and whether the top plan is the measured fastest or within 10% of it, each with the load average.
Acceptance: median |error| <= 25%, Spearman >= 0.8, top plan within 10%.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plan_runs import ROOT, load_average, measure_rounds, run_ranks, spearman, stop_on_signals, wait_for_quiet  # noqa: E402

sys.path.insert(0, ROOT)

# GPT, 8 layers, hidden 256, seq 128, batch 16: a step costs ~20 GFLOP per rank, several times the
# framework's fixed costs, and every layout below is valid at world size 2
MODEL = ["+experiment=tiny_gpt", "model.num_layers=8", "model.hidden_size=256", "model.ffn_hidden_size=1024",
         "model.num_attention_heads=8", "model.seq_length=128", "model.vocab_size=1024",
         "train.global_batch_size=16", "train.eval_iters=0", "train.precision=fp32"]
RUN = ["train.iters=10", "optim.warmup_iters=2"]
OVERLAP = ["optim.overlap_grad_reduce=true", "optim.overlap_param_gather=true"]

LAYOUTS = {
    "dp2": ["parallel.dp=2", "train.micro_batch_size=2"],
    "dp2 zero1": ["parallel.dp=2", "train.micro_batch_size=2", "optim.sharding=optim", *OVERLAP],
    "dp2 zero2": ["parallel.dp=2", "train.micro_batch_size=2", "optim.sharding=optim_grads", *OVERLAP],
    "dp2 zero3": ["parallel.dp=2", "train.micro_batch_size=2", "optim.sharding=optim_grads_params"],
    "dp2 mb1": ["parallel.dp=2", "train.micro_batch_size=1"],
    "dp2 mb8": ["parallel.dp=2", "train.micro_batch_size=8"],
    "dp2 recompute": ["parallel.dp=2", "train.micro_batch_size=2", "train.recompute=full"],
    "tp2": ["parallel.tp=2", "train.micro_batch_size=2"],
    "tp2 sp": ["parallel.tp=2", "parallel.sequence_parallel=true", "train.micro_batch_size=2"],
    "pp2": ["parallel.pp=2", "train.micro_batch_size=2"],
    "pp2 vpp2": ["parallel.pp=2", "parallel.vpp=2", "train.micro_batch_size=2"],
    "pp2 mb1": ["parallel.pp=2", "train.micro_batch_size=1"],
    "cp2": ["parallel.cp=2", "train.micro_batch_size=2"],
}
WORLD = 2


def cluster_of(profile_path: str, devices: int = WORLD, memory_gib: float = 8.0):
    """One node of ``devices`` devices of the profile (memory: far above what the tiny model needs)."""
    from megand.tools.planner.cluster import parse_cluster
    from megand.tools.planner.profile import Profile

    data = {"groups": [{"name": "cpu", "nodes": 1, "devices_per_node": devices, "memory_gib": memory_gib}]}
    return parse_cluster(data, profile=Profile.load(profile_path))


def predicted_step_s(overrides, cluster, stage_groups=None) -> float:
    """The planner's step time for a run config (stage r on ``stage_groups[r]``; default: the first group)."""
    from megand.tools.calibration.predict import candidate_of, predict_config
    from megand.training.config import compose, validate

    cfg = compose(overrides)
    validate(cfg, WORLD)
    groups = stage_groups or [cluster.groups[0]] * candidate_of(cfg, WORLD).pp
    return predict_config(cfg, WORLD, groups).step_time_s


def calibrate(profile: str, quiet) -> None:
    """``tools/calibrate.py`` on WORLD local ranks (the launcher of the measured runs), into ``profile``."""
    wait_for_quiet(quiet)
    print(f"calibrating into {profile}; load average {load_average()}", flush=True)
    run_ranks(["-m", "megand.tools.calibrate", "--output", profile], WORLD)
    print(f"calibrated; load average {load_average()}", flush=True)


def search(cluster, overrides, top: int = 1) -> list:
    """The planner's best plans for ``overrides`` (each pinned, as tools/plan.py takes them) on ``cluster``."""
    from megand.tools.plan import pinned_keys
    from megand.tools.planner.search import Planner, config_validator
    from megand.training.config import compose

    cfg = compose(overrides)
    return Planner(cfg, pinned_keys(overrides), cluster, validate_fn=config_validator(cfg)).plan(top)


def top_plan(cluster, pinned) -> list[str]:
    """The overrides of the planner's best layout for the pinned model and batch on ``cluster``."""
    return search(cluster, pinned)[0].overrides()


def report(rows, top_label, log=print) -> dict:
    errors = [abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"] for r in rows]
    rho = spearman([r["measured_s"] for r in rows], [r["predicted_s"] for r in rows])
    fastest = min(rows, key=lambda r: r["measured_s"])
    top = next(r for r in rows if r["label"] == top_label)
    top_ratio = top["measured_s"] / fastest["measured_s"]
    log(f"{'layout':<20} {'measured ms':>12} {'predicted ms':>13} {'error':>8}  rounds (ms)")
    for r, e in zip(rows, errors):
        sign = "+" if r["predicted_s"] >= r["measured_s"] else "-"
        rounds = " ".join(f"{t * 1e3:.0f}" for t in r["rounds_s"])
        log(f"{r['label']:<20} {r['measured_s'] * 1e3:12.1f} {r['predicted_s'] * 1e3:13.1f} {sign}{e * 100:6.1f}%  {rounds}")
    summary = {"median_abs_error": statistics.median(errors), "spearman": rho, "fastest": fastest["label"],
               "top_plan": top_label, "top_over_fastest": top_ratio, "load_average": load_average()}
    log(f"median |error| {summary['median_abs_error'] * 100:.1f}% (<= 25%: {summary['median_abs_error'] <= 0.25}); "
        f"Spearman {rho:.3f} (>= 0.8: {rho >= 0.8}); top plan '{top_label}' measured {top_ratio:.3f} x the fastest "
        f"'{fastest['label']}' (within 10%: {top_ratio <= 1.10}); load average {summary['load_average']}")
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", required=True, help="profile JSON from tools/calibrate.py")
    p.add_argument("--calibrate", action="store_true", help="calibrate first (2 ranks), writing --profile")
    p.add_argument("--rounds", type=int, default=3, help="measurements of each layout (median)")
    p.add_argument("--only", nargs="*", default=None, help="a subset of the layouts (labels)")
    p.add_argument("--quiet", type=int, default=2,
                   help="before each run wait (15 s at most) until at most this many processes are runnable "
                        "(shared machines); -1: never wait")
    p.add_argument("--measured", default=None,
                   help="a JSON of earlier measurements ({label: [seconds per round]}): reused, and the new ones "
                        "added to it after each run (iterate on the cost model without measuring again)")
    p.add_argument("--json", default=None, help="write the rows and the summary here")
    args = p.parse_args(argv)
    stop_on_signals()
    quiet = None if args.quiet < 0 else args.quiet
    if args.calibrate:
        calibrate(args.profile, quiet)
    cluster = cluster_of(args.profile)
    layouts = {k: v for k, v in LAYOUTS.items() if args.only is None or k in args.only}
    top = top_plan(cluster, MODEL)
    top_label = next((k for k, v in layouts.items() if predicted_same(v, top)), "planner top")
    layouts.setdefault(top_label, top)
    print(f"planner's top plan: {' '.join(top)} ({top_label}); load average {load_average()}")
    known = {}
    if args.measured and os.path.exists(args.measured):
        with open(args.measured) as f:
            known = json.load(f)
    if known.get("planner top overrides") != layouts.get("planner top"):
        known.pop("planner top", None)
    todo = {label: [*MODEL, *RUN, *o] for label, o in layouts.items() if label not in known}

    def record(times):
        if args.measured:
            with open(args.measured, "w") as f:
                json.dump({**known, **{k: v for k, v in times.items() if v},
                           "planner top overrides": layouts.get("planner top")}, f, indent=1)

    print(f"measuring {len(todo)} layouts x {args.rounds} rounds on {WORLD} ranks; load average {load_average()}",
          flush=True)
    known.update(measure_rounds(todo, args.rounds, WORLD, quiet=quiet, record=record))
    rows = [{"label": label, "overrides": layouts[label], "rounds_s": known[label],
             "measured_s": statistics.median(known[label]),
             "predicted_s": predicted_step_s([*MODEL, *layouts[label]], cluster)} for label in layouts]
    summary = report(rows, top_label)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "summary": summary, "profile": args.profile}, f, indent=1)
    return 0


def predicted_same(a, b) -> bool:
    """Two override lists give the same run config."""
    from omegaconf import OmegaConf

    from megand.training.config import compose

    def settings(overrides):
        cfg = compose([*MODEL, *overrides])
        return OmegaConf.to_container(cfg, resolve=False)
    return settings(a) == settings(b)


if __name__ == "__main__":
    sys.exit(main())
