"""Replica shares on this machine: two "device types" made of two cores, the planner's
``parallel.dp_microbatches`` against an even split.

    python benchmarks/plan_shares.py [--rounds 3] [--workdir DIR] [--json F]

As benchmarks/plan_hetero.py: core 0 runs one rank alone, core 1 one rank next to a CPU hog (about half a
core: a slower device), each rank pinned to its core; both calibrated under those conditions
(``tools/calibrate.py --per-rank``), a two-group cluster (``fast``: core 0, ``slow``: core 1, one device
each). Each group holds the whole model, so the planner's replica search (megand/tools/planner/shares.py)
runs one data-parallel replica per group and water-fills the step's micro-batches between them; the
benchmark measures its shares and the even split (same layout, ``parallel.dp_microbatches=null``) in
alternating rounds, the hog running throughout (median step of each run, median over rounds).

Printed: predicted and measured step times, the predicted gain (1 - shares / even), the measured one and
their ratio with the load average. Acceptance: measured gain >= 70% of the predicted gain.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plan_hetero import CORES, calibrate, cluster_of  # noqa: E402
from plan_runs import ROOT, load_average, measure_rounds, start_hog, stop, stop_on_signals  # noqa: E402

sys.path.insert(0, ROOT)

# GPT, 12 layers, hidden 256, seq 128; 16 micro-batches of 1 per step to share between the two replicas
MODEL = ["+experiment=tiny_gpt", "model.num_layers=12", "model.hidden_size=256", "model.ffn_hidden_size=1024",
         "model.num_attention_heads=8", "model.seq_length=128", "model.vocab_size=1024",
         "train.global_batch_size=16", "train.eval_iters=0", "train.precision=fp32"]
PINNED = ["parallel.pp=1", "parallel.tp=1", "parallel.cp=1", "train.micro_batch_size=1", "train.recompute=none",
          "optim.sharding=none"]
RUN = ["train.iters=10", "optim.warmup_iters=2"]


def plan(cluster):
    """The planner's best replica plan (one replica per group) and each group's best plan alone."""
    from megand.tools.plan import pinned_keys
    from megand.tools.planner.search import Planner, config_validator
    from megand.tools.planner.shares import plan_shares
    from megand.training.config import compose

    overrides = [*MODEL, *PINNED]
    cfg = compose(overrides)
    planner = Planner(cfg, pinned_keys(overrides), cluster, validate_fn=config_validator(cfg))
    alone = {}
    for g in cluster.groups:
        best = planner.plan_homogeneous(g, 1)
        alone[g.name] = best[0].prediction.tokens_per_s if best else 0.0
    return plan_shares(planner, 1, alone)[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workdir", default=None, help="keep the profiles here (default: a temporary directory)")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    stop_on_signals()
    if len(os.sched_getaffinity(0)) < 2:
        print("plan_shares: needs two CPU cores (os.sched_getaffinity)", file=sys.stderr)
        return 2
    workdir = args.workdir or tempfile.mkdtemp(prefix="megand-shares-")
    os.makedirs(workdir, exist_ok=True)
    hog = start_hog(CORES["slow"])
    try:
        print(f"calibrating both cores (hog on core {CORES['slow']}); load average {load_average()}", flush=True)
        profiles = calibrate(workdir)
        for name, path in profiles.items():
            with open(path) as f:
                prof = json.load(f)
            print(f"  {name}: peak {prof['peak_tflops'] * 1e3:.1f} GFLOP/s, memory-bound {prof['memory_gbps']:.1f} GB/s",
                  flush=True)
        cluster = cluster_of(profiles)
        best = plan(cluster)
        replicas = [g.name for g in best.replica_groups]
        shares = [*MODEL, *best.overrides()]
        even = [*shares, "parallel.dp_microbatches=null"]
        predicted = {"shares": best.prediction.step_time_s, "even": best.even_step_s}
        print(f"planner: parallel.dp_microbatches={list(best.shares)} on replicas {replicas}; "
              f"{' '.join(best.overrides())}; load average {load_average()}", flush=True)
        cores = [{CORES[n]} for n in replicas]  # rank r is replica r (tp = cp = pp = 1)
        times = measure_rounds({"shares": [*shares, *RUN], "even": [*even, *RUN]}, args.rounds, 2,
                               cores_of=lambda label: cores)
    finally:
        stop(hog)
    measured = {k: statistics.median(v) for k, v in times.items()}
    pred_gain = 1 - predicted["shares"] / predicted["even"]
    meas_gain = 1 - measured["shares"] / measured["even"]
    ratio = meas_gain / pred_gain if pred_gain > 0 else float("nan")
    for k in ("even", "shares"):
        print(f"{k:<7} predicted {predicted[k] * 1e3:8.1f} ms  measured {measured[k] * 1e3:8.1f} ms  "
              f"rounds {' '.join(f'{t * 1e3:.0f}' for t in times[k])}")
    print(f"gain: predicted {pred_gain * 100:.1f}%, measured {meas_gain * 100:.1f}%, ratio {ratio:.2f} "
          f"(>= 0.70: {ratio >= 0.70}); load average {load_average()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shares": list(best.shares), "replicas": replicas, "plan": best.overrides(),
                       "predicted_s": predicted, "measured_s": measured, "rounds_s": times,
                       "predicted_gain": pred_gain, "measured_gain": meas_gain, "ratio": ratio,
                       "load_average": load_average()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
