"""Plan the layout of a run: the fastest predicted layouts of a model on a cluster.

    python tools/plan.py model=llama_70b model.seq_length=8192 train.global_batch_size=512 \\
        --cluster cluster.yaml [--top 5] [--json plans.json] [--profile p.json] [--schedules 1f1b,zb1p] \\
        [--time-budget S] [--verify]

The overrides are the training config's (Hydra, as for ``pretrain_gpt.py``). Every ``key=value`` given
is fixed: the model and the batch, and any ``parallel.*``, ``optim.*`` or ``train.*`` key you pin (so
``parallel.tp=8 parallel.pp=8`` asks what that layout would do); the planner searches the rest: tp, pp,
vpp, cp, dp, sequence parallelism, cp_comm, the pipeline layout, optim.sharding, dp_shard, the
micro-batch size, recompute (and each stage's recomputed layers), the pipeline schedule (``--schedules`` to
restrict it), the overlap flags and (unless pinned) the precision (bf16 on GPUs).

The cluster file (YAML) lists groups of identical nodes; several groups make a heterogeneous cluster,
on which the planner also weighs pipelines across the groups (each stage on one group, with its own
number of layers; each group's stages at their own tp where that is faster, written per stage as
``parallel.pipeline_layout=[{layers:L,tp:T,sp:S},...]``) and replicas of different speeds (each
data-parallel replica on one group, with its own number of micro-batches: ``parallel.dp_microbatches``,
water-filled by predicted speed):

    groups:
      - name: h100
        nodes: 8
        devices_per_node: 8
        device: h100             # optional: a known device (a100, a100-40gb, h100, h200, cpu) supplies the
                                 # numbers below and its profile (GEMM efficiency, collectives)
        peak_tflops: 989         # dense peak per device in the training precision
        memory_gib: 80
        intra_node_gbps: 450     # GB/s per device, one direction, inside a node (collectives' bus bandwidth)
        inter_node_gbps: 50      # GB/s per device, one direction, across nodes
        profile: h100.json       # optional: a profile measured by tools/calibrate.py

Output: a table, best first (predicted step time, tokens/s, TFLOP/s per device, MFU, pipeline bubble,
peak memory per stage against the device memory; a replica plan's shares and predicted speed-ups over
the even split and each group alone), the top plan's overrides to append to ``pretrain_gpt.py``, the node
order to launch with and one ``torchrun`` command per node (``tools/launch.py --world-size=N`` where nodes run
different numbers of processes); ``--time-budget S`` stops the search after S
seconds with the best plans found so far (a line says it was cut); ``--json F`` writes the list of plans (each with
``overrides``, ``world_size``, ``stage_groups``, ``predicted``). Every plan passes the training config's
``validate()`` and fits the memory estimate on every stage. ``--verify`` rehearses the top plan's most
loaded rank on this CPU (tools/rehearse.py) and prints its measured peak memory next to the prediction.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megand.core.pipeline_parallel.registry import schedule_names
from megand.tools.planner.cluster import ClusterError, load_cluster
from megand.tools.progress import heartbeat
from megand.tools.planner.profile import Profile, ProfileError
from megand.tools.planner.search import PlanError, Planner, config_validator
from megand.tools.planner.shares import format_shares, is_replica_plan
from megand.training.config import ConfigError, check_counts, compose


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for pretrain_gpt.py (key=value, model=NAME)")
    p.add_argument("--cluster", required=True, help="the cluster file (YAML, see above)")
    p.add_argument("--top", type=int, default=5, help="plans to show (default 5)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the plans, best first, as a JSON list")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="a device profile from tools/calibrate.py for every group (overrides device:)")
    p.add_argument("--schedules", default=None, metavar="S1,S2",
                   help="the pipeline schedules to search, comma-separated (default: all of "
                        f"{', '.join(schedule_names())})")
    p.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="stop searching after S seconds and show the best plans found so far (a line says the "
                        "search was cut)")
    p.add_argument("--verify", action="store_true",
                   help="rehearse the top plan's most loaded rank on this CPU: measured vs predicted peak memory")
    return p.parse_intermixed_args(argv)


def fail(message) -> int:
    message = str(message).split("Config search path")[0]
    print(f"plan: {' '.join(message.split())}", file=sys.stderr)
    return 2


def pinned_keys(overrides) -> set:
    """The dotted keys the user set on the command line (not group choices such as ``model=NAME``)."""
    keys = set()
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+~")
        if "." in key:
            keys.add(key)
    return keys


def format_table(plans) -> str:
    head = (f"{'#':>2} {'world':>6} {'tp':>3} {'pp':>3} {'vpp':>4} {'cp':>3} {'dp':>5} {'sp':>3} "
            f"{'sharding':>18} {'mbs':>4} {'recompute':>9} {'step s':>9} {'tokens/s':>11} {'TFLOP/s':>8} "
            f"{'MFU':>6} {'bubble':>7} {'mem GiB (max/cap)':>18} {'schedule':>9}  stages")
    lines = [head]
    for i, p in enumerate(plans, 1):
        c, pr = p.candidate, p.prediction
        sharding = c.sharding + (f"/{c.dp_shard}" if c.dp_shard else "")
        worst = max(range(c.pp), key=lambda r: pr.mem_peak_gib[r] / pr.memory_gib[r])
        if is_replica_plan(p):
            stages = "replicas on " + " ".join(f"{g.name}" for g in p.replica_groups)
        elif len({g.name for g in p.stage_groups}) > 1:
            stages = " ".join(f"{g.name}" for g in p.stage_groups)
        else:
            stages = f"{p.stage_groups[0].name} x{c.pp}"
        if c.pipeline_layout:
            stages += f" layers {list(c.pipeline_layout)}"
        if c.cp > 1:
            stages += f" cp_comm={c.cp_comm}"
        tp = "/".join(str(w.tp) for w in c.widths())  # stages of different widths: each width, first stage's first
        lines.append(
            f"{i:>2} {p.world_size:>6} {tp:>3} {c.pp:>3} {str(c.vpp or '-'):>4} {c.cp:>3} {c.dp:>5} "
            f"{'on' if c.sequence_parallel else 'off':>3} {sharding:>18} {c.micro_batch_size:>4} {c.recompute:>9} "
            f"{pr.step_time_s:>9.3f} {pr.tokens_per_s:>11,.0f} {pr.tflops_per_device:>8.4g} {pr.mfu:>6.1%} "
            f"{pr.bubble_fraction:>7.1%} {pr.mem_peak_gib[worst]:>8.1f}/{pr.memory_gib[worst]:<9g} "
            f"{(c.pp_schedule if c.pp > 1 else '-'):>9}  {stages}")
        if is_replica_plan(p):
            lines.append(format_shares(p))
        elif len({g.name for g in p.stage_groups}) > 1:
            lines.append(format_pipeline(p))
        if p.hetero_ratio is not None:
            lines.append(f"   heterogeneous speed-up: {p.hetero_ratio:.3f} x the summed best homogeneous "
                         f"throughput of each group")
    return "\n".join(lines)


def format_pipeline(plan) -> str:
    """Why this heterogeneous pipeline: per group its stages' width, layers and predicted time per
    micro-batch, and the plan's speed-ups over each group alone."""
    c, pr = plan.candidate, plan.prediction
    per_rank = {}
    for r, stages in enumerate(c.parallel.placement.stages_of(r) for r in range(c.pp)):
        per_rank[r] = (sum(c.pipeline_layout[s] for s in stages) if c.pipeline_layout else None,
                       sum(pr.parts["forward_s"][s] + pr.parts["backward_s"][s] for s in stages))
    parts = []
    for name in dict.fromkeys(g.name for g in plan.stage_groups):
        ranks = [r for r, g in enumerate(plan.stage_groups) if g.name == name]
        w = c.of_rank(ranks[0])
        layers = "/".join(str(per_rank[r][0]) for r in ranks)
        parts.append(f"{name}: {len(ranks)} stage(s) of {c.stage_sizes[ranks[0]]} ranks at tp={w.tp}"
                     f"{' sp' if w.sequence_parallel else ''}, {layers} layers, "
                     f"{max(per_rank[r][1] for r in ranks) * 1e3:.1f} ms per micro-batch, "
                     f"{max(pr.mem_peak_gib[r] for r in ranks):.1f}/{plan.stage_groups[ranks[0]].memory_gib:g} GiB")
    s = plan.speedups()
    ratios = [f"{s['fastest_group_alone']:.3f} x the fastest group alone"] if "fastest_group_alone" in s else []
    ratios += [f"{v:.3f} x {k[:-len('_alone')]} alone" for k, v in s.items()
               if k.endswith("_alone") and k != "fastest_group_alone" and v is not None]
    if not ratios:  # every group's best alone is 0 tokens/s: none fits the model
        ratios = ["none to compare (no group alone fits the model)" if plan.alone_tokens_per_s else "none to compare"]
    return f"   stages {'; '.join(parts)}; predicted speed-up: {', '.join(ratios)}"


def launch_commands(user_overrides, plan) -> list:
    """One command per node, node rank 0 first: torchrun with a fixed node rank (rank order is what places
    each stage or replica on its group). Nodes of different process counts (groups of different node
    sizes, stages of different widths) launch through tools/launch.py with ``--world-size``, the processes
    of all nodes, so that the run is validated at its real size before any worker starts."""
    launch = plan.launch()
    nnodes = len(launch["nodes"])
    args = " ".join(shlex.quote(a) for a in [*user_overrides, *plan.overrides()])
    counts = launch["nproc_per_node"]
    runner = "torchrun" if len(set(counts)) == 1 else f"python tools/launch.py --world-size={sum(counts)}"
    return [f"{node}: {runner} --nnodes={nnodes} --node-rank={i} --nproc-per-node={nproc} --master-addr=NODE0 "
            f"--master-port=29500 pretrain_gpt.py {args}"
            for i, (node, nproc) in enumerate(zip(launch["nodes"], counts))]


def verify(user_overrides, plan) -> dict:
    """Rehearse the top plan's most loaded rank (first rank of its fullest stage) on this CPU: the peak
    bytes it held in any phase of a training step (tools/rehearse.py) next to the plan's prediction."""
    from argparse import Namespace

    from megand.tools.rehearse import prepare_config, rehearse

    c, pr = plan.candidate, plan.prediction
    stage = max(range(c.pp), key=lambda r: pr.mem_peak_gib[r] / pr.memory_gib[r])
    rank = sum(c.stage_sizes[:stage]) if c.order.endswith("pp") else 0
    args = Namespace(overrides=list(user_overrides) + plan.overrides(), world_size=c.world_size, rank=rank,
                     microbatches=None)
    cfg, world, _ = prepare_config(args)
    phases = rehearse(cfg, world, rank)["phases"]
    peak_phase = max(phases, key=lambda name: phases[name]["peak_bytes"])
    return {"rank": rank, "stage": stage, "measured_peak_bytes": phases[peak_phase]["peak_bytes"],
            "measured_peak_phase": peak_phase, "predicted_peak_bytes": pr.mem_peak_gib[stage] * 2**30,
            "device_memory_bytes": pr.memory_gib[stage] * 2**30,
            "phases_peak_bytes": {name: ph["peak_bytes"] for name, ph in phases.items()}}


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:,.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.2f} MiB"


def format_verify(v: dict) -> str:
    measured, predicted = v["measured_peak_bytes"], v["predicted_peak_bytes"]
    return (f"verify: rank {v['rank']} (stage {v['stage']}) rehearsed on this CPU: peak {_size(measured)} measured "
            f"({v['measured_peak_phase']}), {_size(predicted)} predicted (measured / predicted {measured / predicted:.2f}; "
            f"device memory {_size(v['device_memory_bytes'])})")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.top < 1:
        return fail(f"--top {args.top} must be >= 1")
    if args.time_budget is not None and not args.time_budget > 0:
        return fail(f"--time-budget {args.time_budget:g} must be a positive number of seconds")
    schedules = None
    if args.schedules is not None:
        schedules = tuple(s.strip() for s in args.schedules.split(",") if s.strip())
        unknown = [s for s in schedules if s not in schedule_names()]
        if unknown or not schedules:
            return fail(f"--schedules {args.schedules}: unknown schedule(s) {', '.join(unknown) or '(none given)'}; "
                        f"choose from {', '.join(schedule_names())}")
    try:
        profile = Profile.load(args.profile) if args.profile else None
        cluster = load_cluster(args.cluster, profile=profile)
    except (ClusterError, ProfileError) as e:
        return fail(e)
    try:
        cfg = compose(args.overrides)
        check_counts(cfg)
    except (HydraException, OmegaConfBaseException, ConfigError) as e:
        return fail(e)
    try:
        planner = Planner(cfg, pinned_keys(args.overrides), cluster, validate_fn=config_validator(cfg),
                          schedules=schedules, time_budget_s=args.time_budget)
        with heartbeat("plan: searching layouts"):
            plans = planner.plan(args.top)
    except PlanError as e:
        return fail(e)
    if planner.cut:
        print(f"plan: the search was cut at the time budget (--time-budget {args.time_budget:g} s): these are the "
              f"best plans found so far; a larger budget may find faster ones")
    if cfg.train.rampup_batch_size is not None:
        print(f"plan: train.rampup_batch_size={list(cfg.train.rampup_batch_size)}: step time and memory at the final "
              f"global batch {cfg.train.global_batch_size}; every layout shown can run each batch of the ramp")
    print(format_table(plans))
    best = plans[0]
    print(f"\nbest: append to pretrain_gpt.py: {' '.join(best.overrides())}")
    launch = best.launch()
    where = (f"replica groups {' '.join(launch['replicas'])}" if is_replica_plan(best)
             else f"stage groups {' '.join(launch['stages'])}")
    print(f"launch: {len(launch['nodes'])} nodes in this order (node rank 0 first): {' '.join(launch['nodes'])}; "
          f"{where}")
    if len(launch["nodes"]) > 1:
        print("launch commands, one per node (NODE0: node rank 0's address):")
        for line in launch_commands(args.overrides, best):
            print(f"  {line}")
    checked = verify(args.overrides, best) if args.verify else None
    if checked:
        print(format_verify(checked))
    if args.json:
        listed = [p.as_dict() for p in plans]
        if checked:
            listed[0]["verify"] = checked
        with open(args.json, "w") as f:
            json.dump(listed, f, indent=1)
    return 0
