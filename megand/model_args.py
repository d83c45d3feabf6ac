"""Command-line flags for a model shape, shared by the tools: a preset or a config file, then overrides.

Flags mirror the ``model.*`` config keys (``--num-layers`` sets ``num_layers``).
"""

import argparse
from pathlib import Path

# Model shapes the tools know by name (the Hydra conf/model group should mirror these).
PRESETS = {
    "gpt2_125m": dict(arch="gpt", num_layers=12, hidden_size=768, ffn_hidden_size=3072, num_attention_heads=12,
                      num_query_groups=12, seq_length=1024, vocab_size=50257, norm="layernorm", activation="gelu",
                      position_embedding="learned", tie_embeddings=True, hidden_dropout=0.1,
                      attention_dropout=0.1),
    "llama_50m": dict(arch="llama", num_layers=8, hidden_size=512, ffn_hidden_size=1408, num_attention_heads=8,
                      num_query_groups=4, seq_length=256, vocab_size=32000, norm="rmsnorm", activation="swiglu",
                      position_embedding="rope", rope_theta=10000.0, tie_embeddings=False, hidden_dropout=0.0,
                      attention_dropout=0.0),
    "llama_8b": dict(arch="llama", num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                     num_query_groups=8, seq_length=8192, vocab_size=128256, norm="rmsnorm", activation="swiglu",
                     position_embedding="rope", rope_theta=500000.0, tie_embeddings=False, hidden_dropout=0.0,
                     attention_dropout=0.0),
    "llama_70b": dict(arch="llama", num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                      num_query_groups=8, seq_length=8192, vocab_size=128256, norm="rmsnorm", activation="swiglu",
                      position_embedding="rope", rope_theta=500000.0, tie_embeddings=False, hidden_dropout=0.0,
                      attention_dropout=0.0),
}


# model config keys settable from the command line: (key, type)
MODEL_KEYS = (("arch", str), ("num_layers", int), ("hidden_size", int), ("ffn_hidden_size", int),
              ("num_attention_heads", int), ("num_query_groups", int), ("seq_length", int), ("vocab_size", int),
              ("norm", str), ("activation", str), ("position_embedding", str), ("rope_theta", float),
              ("init_std", float), ("hidden_dropout", float), ("attention_dropout", float))
REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size")


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model (a preset or a config file, then per-key overrides)")
    group.add_argument("--preset", choices=sorted(PRESETS), help="a known model shape")
    group.add_argument("--model-config", type=Path,
                       help="yaml/json file with the model keys (or with a top-level `model:` group)")
    for key, typ in MODEL_KEYS:
        group.add_argument("--" + key.replace("_", "-"), dest=key, type=typ)
    group.add_argument("--tie-embeddings", dest="tie_embeddings", type=_bool, metavar="BOOL")


def model_config_from_args(args: argparse.Namespace) -> dict:
    model = dict(PRESETS[args.preset]) if args.preset else {}
    if args.model_config:
        import yaml  # installed with omegaconf/hydra; also reads json

        loaded = yaml.safe_load(args.model_config.read_text()) or {}
        model.update(loaded.get("model", loaded))
    for key in [k for k, _ in MODEL_KEYS] + ["tie_embeddings"]:
        if getattr(args, key) is not None:
            model[key] = getattr(args, key)
    missing = [k for k in REQUIRED if k not in model]
    if missing:
        raise SystemExit(f"model config incomplete, missing {missing}: use --preset or --model-config")
    return model
