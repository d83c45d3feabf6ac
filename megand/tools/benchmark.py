"""Benchmark a training config for a fixed number of steps after warm-up; print one JSON line.

The config is the training config (Hydra overrides, as for ``pretrain_gpt.py``):

    python tools/benchmark.py --mode both model=llama_50m train.micro_batch_size=4 --steps 5 --warmup 2
    torchrun --nproc-per-node=8 tools/benchmark.py --mode megand model=llama_8b parallel.tp=8 \\
        parallel.sequence_parallel=true train.micro_batch_size=1 --steps 10

Modes (same keys: tokens_per_s, tflops_per_s per rank, mfu, mem_peak_bytes (max over ranks),
step_time_median_s and spread, ...):
- ``megand``: ``megand.training.pretrain.Trainer`` built in-process, timed ``step()`` calls; one
  micro-batch per data-parallel rank per step unless ``train.global_batch_size`` is given.
- ``baseline``: the same model shape trained by a plain single-process PyTorch/transformers loop.
- ``both``: megand, then the baseline in the same process (rank 0); adds ``baseline`` (its result) and
  ``overhead_ratio`` = baseline tokens/s / megand tokens/s (1.0: no framework overhead) and its inverse
  ``speed_ratio``. ``--rounds N`` alternates the two N times in the same process and keeps each one's best
  round (the machine's load drifts: alternating exposes both to it alike).
On CUDA the default precision is bf16 (``train.precision``) and MFU is against the GPU's peak; on CPU,
fp32 against a measured matmul peak.
"""

import argparse
import sys
import json


import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from megand.tools.benchmark_baseline import run_baseline
from megand.tools.benchmark_megand import benchmark_config, run_megand

MODES = ("megand", "baseline", "both")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for pretrain_gpt.py (model=llama_50m ...)")
    p.add_argument("--mode", choices=MODES, default="megand")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--rounds", type=int, default=1,
                   help="--mode both: alternate megand and the baseline this many times; report each one's best")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: OMP_NUM_THREADS)")
    p.add_argument("--peak-cache-dir", default=None,
                   help="directory that caches the measured CPU peak FLOP/s (default: the run directory)")
    return p.parse_intermixed_args(argv)


def fail(message) -> None:
    """Bad input: one line naming it, exit code 2."""
    message = str(message).split("Config search path")[0]  # Hydra appends its search path: noise here
    print(f"benchmark: {' '.join(message.split())}", file=sys.stderr, flush=True)
    sys.exit(2)


def best(a, b):
    """The faster of two results (None: none yet)."""
    if a is None or b is None:
        return a if b is None else b
    return a if a["tokens_per_s"] >= b["tokens_per_s"] else b


def one_round(args, cuda):
    """megand (every rank), then the baseline (rank 0): ``(megand result, baseline result)`` on rank 0."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from megand.core.checkpointing.errors import CheckpointError
    from megand.data.errors import DataError
    from megand.training.config import ConfigError

    mine = theirs = None
    try:
        cfg = benchmark_config(args.overrides, args.steps, args.warmup, cuda)
        if args.mode in ("megand", "both"):
            mine = run_megand(cfg, args.steps, args.warmup, peak_cache_dir=args.peak_cache_dir)
    except (HydraException, OmegaConfBaseException, ConfigError, DataError, CheckpointError, OSError) as e:
        fail(e)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if args.mode in ("baseline", "both") and rank == 0:
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        theirs = run_baseline(OmegaConf.to_container(cfg.model, resolve=True), cfg.train.micro_batch_size,
                              args.steps, args.warmup, device, cfg.train.precision, seed=cfg.train.seed,
                              peak_cache_dir=args.peak_cache_dir or cfg.run_dir)
    return mine, theirs


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        fail(f"--steps {args.steps} must be >= 1, --warmup {args.warmup} >= 0 and --rounds {args.rounds} >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    result = baseline = None
    for _ in range(args.rounds if args.mode == "both" else 1):
        mine, theirs = one_round(args, cuda)
        result = best(result, mine)
        baseline = best(baseline, theirs)
    if args.mode == "baseline":
        result = baseline
    elif args.mode == "both" and result is not None:
        result.update(mode="both", baseline=baseline, rounds=args.rounds,
                      overhead_ratio=baseline["tokens_per_s"] / result["tokens_per_s"],
                      speed_ratio=result["tokens_per_s"] / baseline["tokens_per_s"])
    rank = dist.get_rank() if dist.is_initialized() else 0
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(result), flush=True)
    return result

