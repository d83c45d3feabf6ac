"""Peak memory of Hugging Face conversion at a real size: a random megand checkpoint of a preset's shape
(written one tensor at a time), exported to safetensors shards, then imported back. Each step runs in its
own process and reports its peak RSS against the model's size in the checkpoint dtype (the ``imports`` step
is the interpreter with torch and transformers loaded, the floor of every step).

    python benchmarks/bench_hf_convert.py --dir /tmp/bench_hf model=llama_1b
    python benchmarks/bench_hf_convert.py --dir /tmp/bench_hf model=llama_1b --dtype bf16 --max-shard-size 1GB

Prints one JSON line; `--keep` leaves the files in --dir.
"""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time


STEPS = ("imports", "create", "export", "import")  # imports: the interpreter, torch and transformers alone


def run_step(args, overrides) -> dict:
    """One step in this process; returns its time and peak RSS."""
    import torch
    from omegaconf import OmegaConf

    from megand.models import full
    from megand.tools import convert_checkpoint
    from megand.training.config import compose

    ckpt, hf_dir, back = (os.path.join(args.dir, n) for n in ("megand", "hf", "imported"))
    import transformers  # noqa: F401  (loaded by export and import too: part of every step's baseline)

    start = time.perf_counter()
    if args.step == "imports":
        pass
    elif args.step == "create":
        model_cfg = OmegaConf.to_container(compose(overrides).model, resolve=True)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
        full.save_random_model(ckpt, model_cfg, dtype)
    elif args.step == "export":
        rc = convert_checkpoint.main(["export", "--load", ckpt, "--out", hf_dir, "--max-shard-size", args.max_shard_size])
        assert rc == 0
    else:
        rc = convert_checkpoint.main(["import", "--hf", hf_dir, "--save", back])
        assert rc == 0
    return {"seconds": time.perf_counter() - start,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="scratch directory (emptied first)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--max-shard-size", default="1GB")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--step", choices=STEPS, help=argparse.SUPPRESS)  # internal: run one step
    args, overrides = p.parse_known_args()
    if args.step:
        print(json.dumps(run_step(args, overrides)))
        return 0

    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    result = {"overrides": overrides, "dtype": args.dtype, "max_shard_size": args.max_shard_size}
    for step in STEPS:
        cmd = [sys.executable, os.path.abspath(__file__), "--dir", args.dir, "--dtype", args.dtype,
               "--max-shard-size", args.max_shard_size, "--step", step, *overrides]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            sys.stderr.write(proc.stderr)
            return proc.returncode
        result[step] = json.loads(proc.stdout.strip().splitlines()[-1])
    model_bytes = sum(os.path.getsize(os.path.join(args.dir, "hf", n)) for n in os.listdir(os.path.join(args.dir, "hf"))
                      if n.endswith(".safetensors"))
    result["model_bytes"] = model_bytes
    result["hf_files"] = sorted(os.listdir(os.path.join(args.dir, "hf")))
    for step in STEPS:
        result[step]["peak_rss_over_model"] = result[step]["peak_rss_bytes"] / model_bytes
    if not args.keep:
        shutil.rmtree(args.dir)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
