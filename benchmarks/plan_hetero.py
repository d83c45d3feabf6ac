"""Heterogeneous rehearsal of the planner on this machine: two "device types" made of two cores.

    python benchmarks/plan_hetero.py [--rounds 3] [--workdir DIR]

Core 0 runs one rank alone; core 1 runs one rank next to a CPU hog (a busy loop pinned to it), so that
rank gets about half a core: a slower device. Each rank is pinned to its core (os.sched_setaffinity).

1. Calibrate both under those conditions: ``tools/calibrate.py --per-rank`` on 2 ranks pinned so (the
   hog running), giving one profile per core (GEMM curve, bandwidth, overheads; shared collectives).
2. A two-group cluster (``fast``: core 0, ``slow``: core 1, one device each) and the planner's search
   for MODEL with pp=2 pinned: its plan should be uneven (more layers on the fast stage,
   ``parallel.pipeline_layout``); the stage -> group assignment it prints decides which core each rank
   is pinned to.
3. Measure the planner's layout and the even layout (same placement) in alternating rounds, the hog
   running throughout (median step of each run, median over rounds), and predict both.

Printed: predicted and measured step times, the predicted improvement (1 - uneven / even), the
measured one, and their ratio with the load average. Acceptance: measured improvement >= 70% of the
predicted improvement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plan_runs import ROOT, load_average, measure_rounds, run_ranks, start_hog, stop, stop_on_signals  # noqa: E402

sys.path.insert(0, ROOT)

# GPT, 12 layers (fine enough a split), hidden 256, seq 128, 8 micro-batches of 2 per step
MODEL = ["+experiment=tiny_gpt", "model.num_layers=12", "model.hidden_size=256", "model.ffn_hidden_size=1024",
         "model.num_attention_heads=8", "model.seq_length=128", "model.vocab_size=1024",
         "train.global_batch_size=16", "train.eval_iters=0", "train.precision=fp32"]
PINNED = ["parallel.pp=2", "parallel.tp=1", "parallel.cp=1", "parallel.vpp=null", "train.micro_batch_size=2",
          "train.recompute=none"]
RUN = ["train.iters=10", "optim.warmup_iters=2"]
CORES = {"fast": 0, "slow": 1}  # the hog shares the slow group's core


def calibrate(workdir: str) -> dict:
    """{group name: profile path}: one calibration, each rank on its group's core."""
    out = os.path.join(workdir, "hetero.json")
    run_ranks(["-m", "megand.tools.calibrate", "--output", out, "--per-rank", "--name", "hetero-cpu"], 2,
              cores=[{CORES["fast"]}, {CORES["slow"]}])
    return {"fast": os.path.join(workdir, "hetero.rank0.json"), "slow": os.path.join(workdir, "hetero.rank1.json")}


def cluster_of(profiles: dict, memory_gib: float = 8.0):
    from megand.tools.planner.cluster import parse_cluster

    data = {"groups": [{"name": name, "nodes": 1, "devices_per_node": 1, "memory_gib": memory_gib,
                        "profile": path} for name, path in profiles.items()]}
    return parse_cluster(data)


def plan(cluster):
    from plan_accuracy import search

    return search(cluster, [*MODEL, *PINNED])[0]


def predicted_step_s(overrides, stage_groups) -> float:
    from megand.tools.calibration.predict import predict_config
    from megand.training.config import compose, validate

    cfg = compose(overrides)
    validate(cfg, 2)
    return predict_config(cfg, 2, stage_groups).step_time_s


def improvement(predicted: dict, times: dict) -> dict:
    """Step times (median of the rounds) and the uneven layout's gain over the even one (1 - uneven / even),
    predicted and measured, and their ratio (nan when the planner predicts no gain: it chose the even one)."""
    measured = {k: statistics.median(v) for k, v in times.items()}
    pred_gain = 1 - predicted["uneven"] / predicted["even"]
    meas_gain = 1 - measured["uneven"] / measured["even"]
    return {"predicted_s": predicted, "measured_s": measured, "predicted_gain": pred_gain, "measured_gain": meas_gain,
            "ratio": meas_gain / pred_gain if pred_gain > 0 else float("nan")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workdir", default=None, help="keep the profiles here (default: a temporary directory)")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    stop_on_signals()
    if len(os.sched_getaffinity(0)) < 2:
        print("plan_hetero: needs two CPU cores (os.sched_getaffinity)", file=sys.stderr)
        return 2
    workdir = args.workdir or tempfile.mkdtemp(prefix="megand-hetero-")
    os.makedirs(workdir, exist_ok=True)
    hog = start_hog(CORES["slow"])
    try:
        print(f"calibrating both cores (hog on core {CORES['slow']}); load average {load_average()}")
        profiles = calibrate(workdir)
        for name, path in profiles.items():
            with open(path) as f:
                prof = json.load(f)
            print(f"  {name}: peak {prof['peak_tflops'] * 1e3:.1f} GFLOP/s, memory-bound {prof['memory_gbps']:.1f} GB/s, "
                  f"overheads {', '.join(f'{k} {v * 1e3:.3f} ms' for k, v in prof['overhead_s'].items())}")
        cluster = cluster_of(profiles)
        best = plan(cluster)
        groups = {g.name: g for g in cluster.groups}
        stage_names = [g.name for g in best.stage_groups]
        stage_groups = [groups[n] for n in stage_names]
        uneven = [*MODEL, *best.overrides()]
        even = [*uneven, "parallel.pipeline_layout=null"]
        print(f"planner: {' '.join(best.overrides())}; stages on {stage_names}; load average {load_average()}")
        cores = [{CORES[n]} for n in stage_names]
        predicted = {"uneven": predicted_step_s(uneven, stage_groups), "even": predicted_step_s(even, stage_groups)}
        times = measure_rounds({"uneven": [*uneven, *RUN], "even": [*even, *RUN]}, args.rounds, 2,
                               cores_of=lambda label: cores)
    finally:
        stop(hog)
    figures = improvement(predicted, times)
    for k in ("even", "uneven"):
        print(f"{k:<7} predicted {predicted[k] * 1e3:8.1f} ms  measured {figures['measured_s'][k] * 1e3:8.1f} ms  "
              f"rounds {' '.join(f'{t * 1e3:.0f}' for t in times[k])}")
    ratio = figures["ratio"]
    print(f"improvement: predicted {figures['predicted_gain'] * 100:.1f}%, measured {figures['measured_gain'] * 100:.1f}%, "
          f"ratio {ratio:.2f} (>= 0.70: {ratio >= 0.70}); load average {load_average()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"plan": best.overrides(), "stages": stage_names, "rounds_s": times, **figures,
                       "load_average": load_average()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
