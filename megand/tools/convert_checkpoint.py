"""Convert between megand checkpoints (any parallel layout) and Hugging Face ``transformers`` directories.

    python tools/convert_checkpoint.py export --load ckpts/run --out hf/run
        megand checkpoint (a save dir with `latest`, or an iter_NNNNNNN dir) -> LlamaForCausalLM (llama) or
        GPT2LMHeadModel (gpt) as safetensors + config.json
    python tools/convert_checkpoint.py import --hf hf/run --save ckpts/imported
        transformers directory -> megand checkpoint (model only, iteration 0), loadable at any layout with
        `checkpoint.load=ckpts/imported`
"""

import argparse
import sys


from omegaconf import OmegaConf

from megand.core.checkpointing import CheckpointError, offline
from megand.models import full, hf


def export(load: str, out: str) -> None:
    model_cfg = OmegaConf.to_container(full.read_config(load).model, resolve=True)
    tensors = offline.load_full_tensors(load)
    hf.export(tensors, model_cfg, out)
    print(f"exported {load} ({hf.hf_kind(model_cfg)}, {sum(t.numel() for t in tensors.values()):,} parameters) to {out}")


def import_(hf_dir: str, save: str) -> None:
    config, sd = hf.load_hf(hf_dir)
    model_cfg, tensors = hf.from_hf(config, sd)
    full.build_full_model(model_cfg, tensors)  # checks names and shapes against a megand model
    config_yaml = OmegaConf.to_yaml({"model": model_cfg})
    path = offline.save_full_model(save, tensors, config_yaml, model_cfg)
    print(f"imported {hf_dir} ({config.model_type}) to {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="megand checkpoint -> Hugging Face directory")
    e.add_argument("--load", required=True, help="megand save dir (with `latest`) or iteration dir")
    e.add_argument("--out", required=True, help="output transformers directory")
    i = sub.add_parser("import", help="Hugging Face directory -> megand checkpoint")
    i.add_argument("--hf", required=True, help="transformers directory (llama or gpt2)")
    i.add_argument("--save", required=True, help="megand save dir to create (iter_0000000 + latest)")
    args = p.parse_args(argv)
    try:
        if args.command == "export":
            export(args.load, args.out)
        else:
            import_(args.hf, args.save)
    except (CheckpointError, ValueError) as err:
        print(f"convert_checkpoint: {err}", file=sys.stderr)
        return 2
    return 0

