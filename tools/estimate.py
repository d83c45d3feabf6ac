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

try:
    import megand  # noqa: F401
except ImportError:  # running from a source checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megand.estimate import PRESETS, Layout, estimate_memory, format_report  # noqa: E402

# model config keys settable from the command line: (key, type)
MODEL_KEYS = [("arch", str), ("num_layers", int), ("hidden_size", int), ("ffn_hidden_size", int),
              ("num_attention_heads", int), ("num_query_groups", int), ("seq_length", int), ("vocab_size", int),
              ("norm", str), ("activation", str), ("position_embedding", str), ("hidden_dropout", float),
              ("attention_dropout", float)]


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("model (a preset or a config file, then per-key overrides)")
    src.add_argument("--preset", choices=sorted(PRESETS), help="a known model shape")
    src.add_argument("--model-config", type=Path,
                     help="yaml/json file with the model keys (or with a top-level `model:` group)")
    for key, typ in MODEL_KEYS:
        src.add_argument("--" + key.replace("_", "-"), dest=key, type=typ)
    src.add_argument("--tie-embeddings", dest="tie_embeddings", type=_bool, metavar="BOOL")

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


def load_model_config(args: argparse.Namespace) -> dict:
    model = dict(PRESETS[args.preset]) if args.preset else {}
    if args.model_config:
        import yaml  # comes with omegaconf/hydra

        loaded = yaml.safe_load(args.model_config.read_text()) or {}
        model.update(loaded.get("model", loaded))
    model.update({k: getattr(args, k) for k, _ in MODEL_KEYS + [("tie_embeddings", bool)]
                  if getattr(args, k) is not None})
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size")
               if k not in model]
    if missing:
        raise SystemExit(f"model config incomplete, missing {missing}: use --preset or --model-config")
    return model


def main(argv=None) -> None:
    args = parse_args(argv)
    model = load_model_config(args)
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
