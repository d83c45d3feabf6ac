"""Measure this machine (or a GPU) for the layout planner and write the profile ``tools/plan.py --profile`` reads.

    python tools/calibrate.py --nproc 2 --output cpu.json                  # CPU: 2 ranks, one per core
    torchrun --nproc-per-node=8 tools/calibrate.py --output h100.json      # GPUs (nccl), same code
    python tools/calibrate.py --nproc 2 --output cpu.json --per-rank model=llama_tiny

Every rank of the process group (launched by torchrun, or by ``--nproc N`` which starts torchrun on this
node; device and backend from megand.core.parallel_state) measures, at the same time as the others:

- GEMM throughput ``(m x k) @ (k x n)`` over a grid of shapes (``--gemm-sizes``; m stands for the tokens
  of a micro-batch, n and k for a layer's sharded widths); ``peak_tflops`` is the best point;
- the effective bandwidth of memory-bound work (adds, GELU, layer norm, softmax, an AdamW update) at a
  few tensor sizes: ``memory_gbps`` is the median;
- collectives (all_reduce, all_gather, reduce_scatter, p2p ping-pong, all_to_all) over the group, for
  message sizes from 1 KiB to ``--max-message-mib``, each fitted to ``alpha_s + factor * bytes / gbps``
  with NCCL-tests' bus factors. A group inside one node gives ``intra_node``; when the world spans
  nodes the world group gives ``inter_node`` and each node's group ``intra_node``. A link that could not
  be measured (one node; one device per node) is a copy of the other, and the profile's ``source`` says so;
- fixed framework costs: tiny one-process ``pretrain_gpt.py`` runs (layer and micro-batch counts of
  megand.tools.calibration.overheads.DESIGN; Hydra overrides given here, e.g. ``model=llama_tiny``,
  apply to them) whose step times beyond the modelled compute are fitted to ``per_step + microbatches x
  (per_microbatch + layers x per_layer_step)``; ``--no-overheads`` writes zeros.

The profile holds the median over ranks of each compute figure; ``--per-rank`` also writes
``<output>.rank<R>.json`` with rank R's own compute figures (ranks on different device kinds, or on
cores of unequal load, give one profile each) and the shared collectives. On this repository's 2-core
CPU machine a calibration takes a few minutes; timings are medians of repeated calls.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile

PROFILE_KEYS = ("name", "source", "dtype", "peak_tflops", "gemm", "memory_gbps", "overhead_s", "collectives")
DTYPES = ("fp32", "bf16", "fp16")
KIB = 1024


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="tools/calibrate.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--output", required=True, help="profile JSON to write (rank 0)")
    p.add_argument("--name", default=None, help="the profile's name (default: device, dtype, ranks and backend)")
    p.add_argument("--nproc", type=int, default=None,
                   help="start this many ranks on this node with torchrun (default: the launcher's world)")
    p.add_argument("--per-rank", action="store_true", help="also write <output>.rank<R>.json for each rank")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="GEMM dtype (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--gemm-sizes", default=None,
                   help="comma-separated sizes for m, n and k (default: 32,128,512,2048 on CPU; 256..16384 on CUDA)")
    p.add_argument("--max-message-mib", type=float, default=None,
                   help="largest collective buffer (default: 16 on CPU, 256 on CUDA)")
    p.add_argument("--no-overheads", action="store_true", help="skip the training runs; overheads are written as 0")
    p.add_argument("--quick", action="store_true", help="fewer points and shorter timings (smoke tests)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for the overhead runs (e.g. model=llama_tiny)")
    args = p.parse_args(argv)
    _check_args(args)
    return args


class InputError(ValueError):
    """Bad command-line input: reported as one line, exit code 2."""


def _check_args(args) -> None:
    """Bad input: one line naming the values, before any measurement."""
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir) or not os.access(out_dir, os.W_OK):
        raise InputError(f"--output {args.output}: directory {out_dir} does not exist or is not writable")
    if args.nproc is not None and args.nproc < 2:
        raise InputError(f"--nproc {args.nproc}: collectives need at least 2 ranks")
    if args.gemm_sizes is not None:
        try:
            sizes = [int(s) for s in args.gemm_sizes.split(",")]
        except ValueError:
            sizes = []
        if not sizes or min(sizes) < 1:
            raise InputError(f"--gemm-sizes {args.gemm_sizes!r}: expected positive integers separated by commas")
    if args.max_message_mib is not None and args.max_message_mib * 1024 < 4:
        raise InputError(f"--max-message-mib {args.max_message_mib}: must be at least 4 KiB (0.004)")
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        raise InputError(f"{' '.join(bad)}: Hydra overrides are key=value")
    if not args.no_overheads:
        _check_overhead_overrides(args.overrides)


def _check_overhead_overrides(overrides) -> None:
    """The overhead runs' configs compose and validate (as pretrain_gpt.py would), before any work."""
    from megand.tools.calibration.overheads import DESIGN, run_overrides
    from megand.training.config import ConfigError, compose, validate

    for layers, microbatches in DESIGN:
        try:
            validate(compose(run_overrides(layers, microbatches, overrides)), world_size=1)
        except ConfigError as e:
            raise InputError(f"overhead run with {' '.join(overrides)}: {e}") from None
        except Exception as e:  # Hydra's errors for unknown groups or keys
            raise InputError(f"overhead run with {' '.join(overrides)}: {' '.join(str(e).split())}") from None


def relaunch_with_torchrun(args, argv) -> int:
    """``--nproc N`` outside a launcher: run this command again on N ranks through torchrun."""
    import subprocess

    rest = [a for a in argv if not a.startswith("--nproc=")]
    if "--nproc" in rest:  # drop its value too
        i = rest.index("--nproc")
        rest = rest[:i] + rest[i + 2:]
    # the ranks import the same megand as this process
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           "-m", "megand.tools.calibrate", *rest]
    return subprocess.call(cmd, env=env)


def default_sizes(device_type: str, args):
    cuda = device_type == "cuda"
    if args.gemm_sizes:
        gemm = [int(s) for s in args.gemm_sizes.split(",")]
    elif args.quick:
        gemm = [32, 256]
    else:
        gemm = [256, 1024, 4096, 16384] if cuda else [32, 128, 512, 2048]
    max_bytes = int((args.max_message_mib or (256 if cuda else 16)) * KIB * KIB)
    if args.quick:
        max_bytes = min(max_bytes, 256 * KIB)
    messages, size = [], KIB
    while size <= max_bytes:
        messages.append(size)
        size *= 4
    # CPU: the sizes of a CPU-sized model's activations (cache-resident, as they are in its steps)
    memory = [1 << 16, 1 << 20] if args.quick else ([1 << 22, 1 << 26] if cuda else [1 << 16, 1 << 18, 1 << 20])
    return gemm, messages, memory


def link_groups(world: int, local_world: int):
    """(link name, group) pairs to measure: the world group spans nodes when local_world < world. Every
    rank must create every node group (torch's rule), so they are built here on all ranks."""
    import torch.distributed as dist

    if local_world >= world:
        return [("intra_node", None)]
    pairs = [("inter_node", None)]
    if local_world > 1:
        node_groups = [dist.new_group(list(range(s, s + local_world))) for s in range(0, world, local_world)]
        pairs.append(("intra_node", node_groups[dist.get_rank() // local_world]))
    return pairs


def measure_collectives(device, messages, quick: bool) -> tuple[dict, dict, list[str]]:
    """Fitted alpha-beta per link and op, the raw points, and notes on links copied rather than measured."""
    import torch.distributed as dist

    from megand.tools.calibration.fit import fit_alpha_beta
    from megand.tools.calibration.measure import COLLECTIVES, measure_collective

    world = dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    fitted, raw, notes = {}, {}, []
    for link, group in link_groups(world, local_world):
        n = dist.get_world_size(group)
        fitted[link], raw[link] = {}, {}
        for op in COLLECTIVES:
            points = measure_collective(op, messages, device, group, reps=2 if quick else 5, batches=3 if quick else 5)
            raw[link][op] = points
            fitted[link][op] = fit_alpha_beta(op, n, [p["bytes"] for p in points], [p["seconds"] for p in points])
    for link, other in (("inter_node", "intra_node"), ("intra_node", "inter_node")):
        if link not in fitted:
            fitted[link] = {op: dict(v) for op, v in fitted[other].items()}
            notes.append(f"{link} copied from {other} (not measurable on this launch)")
    return fitted, raw, notes


def modelled_compute_s(cfg, gemm_points, memory_gbps: float, collectives: dict) -> float:
    """The planner's step time of a one-process overhead run on this rank's figures, overheads left out:
    what the fitted overheads must add to it is the framework's cost."""
    from megand.tools.calibration.predict import one_device_group, predict_config
    from megand.tools.planner.profile import Profile

    profile = Profile.from_dict({"name": "this rank, no overheads", "peak_tflops": max(p["tflops"] for p in gemm_points),
                                 "gemm": gemm_points, "memory_gbps": memory_gbps, "collectives": collectives})
    return predict_config(cfg, 1, [one_device_group(profile)]).step_time_s


def measure_overheads(overrides, device, gemm_points, memory_gbps: float, collectives: dict, quick: bool) -> tuple[dict, list[dict]]:
    """Fitted overheads and the runs behind them (each rank runs the same design, all at once)."""
    import torch.distributed as dist

    from megand.tools.calibration import overheads as oh
    from megand.tools.calibration.fit import fit_overheads
    from megand.training.config import compose

    design = oh.DESIGN[:3] if quick else oh.DESIGN
    samples = []
    with tempfile.TemporaryDirectory(prefix="megand-calibrate-") as workdir:
        for layers, microbatches in design:
            run = oh.run_overrides(layers, microbatches, overrides)
            cfg = compose(run)
            dist.barrier()  # every rank's run at the same time: the contention of a job of this size
            measured = oh.one_process_step_seconds(run, workdir, device)
            modelled = modelled_compute_s(cfg, gemm_points, memory_gbps, collectives)
            samples.append({"layers": layers, "microbatches": microbatches, "measured_s": measured,
                            "modelled_s": modelled})
    return fit_overheads(samples), samples


def rank_measurements(args, device, dtype_name: str, collectives: dict) -> dict:
    """This rank's compute figures: GEMM points, memory-bound bandwidth, overheads."""
    import torch

    from megand.tools.calibration.measure import gemm_shapes, measure_gemm, measure_memory_bandwidth

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    gemm_sizes, _, memory_sizes = default_sizes(device.type, args)
    min_time = 0.01 if args.quick else 0.1
    gemm = measure_gemm(device, dtype, gemm_shapes(gemm_sizes), min_time)
    bandwidth = measure_memory_bandwidth(device, torch.float32, memory_sizes, min_time)
    if args.no_overheads:
        overheads, runs = {"per_layer_step": 0.0, "per_microbatch": 0.0, "per_step": 0.0}, []
    else:
        memory_gbps = statistics.median(p["gbps"] for p in bandwidth)
        overheads, runs = measure_overheads(args.overrides, device, gemm, memory_gbps, collectives, args.quick)
    return {"gemm": gemm, "bandwidth": bandwidth, "overheads": overheads, "overhead_runs": runs}


def build_profile(name: str, source: str, dtype: str, ranks: list[dict], collectives: dict) -> dict:
    """The profile (planner format) from the compute figures of ``ranks`` (median over them) and the
    fitted collectives."""
    gemm = [{"m": p["m"], "n": p["n"], "k": p["k"],
             "tflops": statistics.median(r["gemm"][i]["tflops"] for r in ranks)}
            for i, p in enumerate(ranks[0]["gemm"])]
    memory_gbps = statistics.median(statistics.median(p["gbps"] for p in r["bandwidth"]) for r in ranks)
    overheads = {k: statistics.median(r["overheads"][k] for r in ranks) for k in ranks[0]["overheads"]}
    return {"name": name, "source": source, "dtype": dtype, "peak_tflops": max(p["tflops"] for p in gemm),
            "gemm": gemm, "memory_gbps": memory_gbps, "overhead_s": overheads, "collectives": collectives}


def load_average() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


def write_json(path: str, obj) -> None:
    import json

    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def rank_path(output: str, rank: int) -> str:
    stem, ext = os.path.splitext(output)
    return f"{stem}.rank{rank}{ext or '.json'}"


def calibrate(args) -> int:
    import warnings

    import torch.distributed as dist

    from megand.core.parallel_state import choose_device_and_backend, init_distributed

    # torch 2.13 marks all_gather_into_tensor / reduce_scatter_tensor deprecated; megand uses them too
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    device = init_distributed()
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        if world < 2:
            if rank == 0:
                print("calibrate: collectives need at least 2 ranks: use --nproc 2 or torchrun --nproc-per-node=N",
                      file=sys.stderr)
            return 2
        backend = choose_device_and_backend()[1]
        dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
        _, messages, _ = default_sizes(device.type, args)
        start_load = load_average()
        collectives, raw, notes = measure_collectives(device, messages, args.quick)
        mine = rank_measurements(args, device, dtype, collectives)
        ranks = [None] * world
        dist.all_gather_object(ranks, mine)
        if args.per_rank:
            # each rank writes its own: ranks on other nodes see other file systems
            write_profile(rank_path(args.output, rank), args, dtype, backend, world, device, [mine], collectives,
                          notes + [f"rank {rank} only"], start_load)
        if rank == 0:
            path = write_profile(args.output, args, dtype, backend, world, device, ranks, collectives,
                                 notes + [f"median of {world} ranks"], start_load)
            print(summary(path, ranks, collectives, raw))
        dist.barrier()
        return 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def write_profile(path, args, dtype, backend, world, device, ranks, collectives, notes, start_load) -> str:
    import torch

    kind = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu-1core" if \
        int(os.environ.get("OMP_NUM_THREADS", "0")) == 1 else "cpu"
    name = args.name or f"{kind}-{dtype}-{world}ranks-{backend}"
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    source = (f"measured by tools/calibrate.py on {when}; {world} ranks on {device.type} ({backend}); "
              f"load average {start_load} at start, {load_average()} at end; {'; '.join(notes)}")
    write_json(path, build_profile(name, source, dtype, ranks, collectives))
    return path


def summary(path, ranks, collectives, raw) -> str:
    lines = [f"wrote {path}"]
    for r, m in enumerate(ranks):
        peak = max(p["tflops"] for p in m["gemm"])
        bw = statistics.median(p["gbps"] for p in m["bandwidth"])
        o = m["overheads"]
        lines.append(f"rank {r}: peak {peak * 1e3:.1f} GFLOP/s, memory-bound {bw:.2f} GB/s, overheads: "
                     f"per layer-step {o['per_layer_step'] * 1e3:.3f} ms, per micro-batch {o['per_microbatch'] * 1e3:.3f} ms,"
                     f" per step {o['per_step'] * 1e3:.3f} ms")
        for run in m["overhead_runs"]:
            lines.append(f"    {run['layers']} layers x {run['microbatches']} micro-batches: measured "
                         f"{run['measured_s'] * 1e3:.2f} ms, modelled compute {run['modelled_s'] * 1e3:.2f} ms")
        faster = [run for run in m["overhead_runs"] if run["measured_s"] < run["modelled_s"]]
        if faster:
            lines.append(f"    WARNING: {len(faster)} training run(s) faster than the compute measured before them: "
                         f"the machine's load changed during the calibration; its figures are unreliable (run it again)")
    for link, ops in collectives.items():
        for op, fit in ops.items():
            lines.append(f"{link} {op}: alpha {fit['alpha_s'] * 1e6:.1f} us, {fit['gbps']:.2f} GB/s")
    lines.append(f"load average now {load_average()}")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv)
    except InputError as e:
        print(f"calibrate: {e}", file=sys.stderr)
        return 2
    if args.nproc is not None and "RANK" not in os.environ:
        return relaunch_with_torchrun(args, argv)
    return calibrate(args)


if __name__ == "__main__":
    sys.exit(main())
