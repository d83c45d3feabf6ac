"""Estimate per-rank memory (parameters, optimizer states, activations) for a model and layout.

    python tools/estimate.py --preset llama_8b --tp 8 --sequence-parallel --recompute selective
    python tools/estimate.py --model-config conf/model/llama_8b.yaml --pp 4 --vpp 2 --dp 8 \\
        --distributed-optimizer --global-batch-size 256 --json

The formulas and what they leave out are documented in megand/estimate.py.
"""

import argparse
import json
import sys
from pathlib import Path

# Tools run from a source tree: import the megand of this checkout, even when another copy is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megand.estimate import Layout, estimate_memory, format_report  # noqa: E402
from megand.model_args import add_model_args, model_config_from_args  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)

    lay = p.add_argument_group("layout")
    for name in ("tp", "pp", "cp", "dp"):
        lay.add_argument("--" + name, type=int, default=1)
    lay.add_argument("--vpp", type=int, default=None, help="virtual stages per pipeline rank (interleaved 1F1B)")
    lay.add_argument("--sequence-parallel", action="store_true")
    lay.add_argument("--distributed-optimizer", action="store_true")
    lay.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="bf16")
    lay.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
    lay.add_argument("--fused-attention", action="store_true",
                     help="flash/memory-efficient attention: the s x s attention probabilities are not stored")
    lay.add_argument("--micro-batch-size", type=int, default=1)
    lay.add_argument("--global-batch-size", type=int, default=None,
                     help="sets the number of micro-batches per step (default: enough to fill the pipeline)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    model = model_config_from_args(args)
    num_micro = None
    if args.global_batch_size:
        num_micro, rest = divmod(args.global_batch_size, args.micro_batch_size * args.dp)
        if rest or not num_micro:
            raise SystemExit("global batch size must be a multiple of micro batch size × dp")
    layout = Layout(tp=args.tp, pp=args.pp, vpp=args.vpp, cp=args.cp, dp=args.dp,
                    sequence_parallel=args.sequence_parallel, distributed_optimizer=args.distributed_optimizer,
                    precision=args.precision, recompute=args.recompute, micro_batch_size=args.micro_batch_size,
                    num_microbatches=num_micro, fused_attention=args.fused_attention)
    estimate = estimate_memory(model, layout)
    if args.json:
        print(json.dumps({"model": model, "layout": vars(layout), "memory": estimate.as_dict()}))
    else:
        print(format_report(model, layout, estimate))


if __name__ == "__main__":
    main()
