"""Benchmark a model shape for a fixed number of steps after warm-up; print one JSON line.

    python tools/benchmark.py --mode baseline --preset llama_50m --micro-batch-size 4 --steps 5 --warmup 2

Modes share one signature, ``fn(model_cfg, micro_batch, steps, warmup, device, dtype, **options) -> dict``,
and return the same keys (tokens_per_s, tflops_per_s, mfu, mem_peak_bytes, step_time_median_s, ...):
``baseline`` is a plain single-process PyTorch/transformers loop of the same shape.
"""

import argparse
import json
import sys
from pathlib import Path

# Tools run from a source tree: import the megand of this checkout, even when another copy is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megand.benchmark_baseline import run_baseline  # noqa: E402
from megand.model_args import add_model_args, model_config_from_args  # noqa: E402

MODES = {"baseline": run_baseline}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=sorted(MODES), default="baseline")
    add_model_args(p)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None,
                   help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: OMP_NUM_THREADS)")
    p.add_argument("--peak-cache-dir", default=None,
                   help="directory that caches the measured CPU peak FLOP/s (e.g. the run directory)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    result = MODES[args.mode](model_config_from_args(args), args.micro_batch_size, args.steps, args.warmup,
                              device, precision, peak_cache_dir=args.peak_cache_dir)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
