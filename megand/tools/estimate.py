"""Estimate per-rank memory (parameters, optimizer states, activations) for a run's config and layout.

The model and layout are the training config: Hydra overrides, composed exactly as ``pretrain_gpt.py``
composes them (``model=`` picks a conf/model preset, ``+experiment=`` a whole experiment):

    python tools/estimate.py model=llama_8b parallel.tp=8 parallel.sequence_parallel=true \\
        train.recompute=selective train.precision=bf16 --world-size 64
    python tools/estimate.py +experiment=llama70b_64gpu --world-size 64 --json

``--world-size`` fills ``parallel.dp: null`` (default: tp·pp·cp, i.e. dp=1). The formulas and what they
leave out are documented in megand/tools/estimate_memory.py.
"""

import argparse
import dataclasses
import json
import sys


from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megand.core.parallel_layout import LayoutError, ParallelLayout
from megand.training.config import ConfigError, check_counts, compose, validate
from megand.tools.estimate_memory import Layout, estimate_memory, format_report


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for pretrain_gpt.py (key=value, model=NAME)")
    p.add_argument("--world-size", type=int, default=None, help="ranks of the run (default: tp*pp*cp*(dp or 1))")
    p.add_argument("--fused-attention", action="store_true",
                   help="flash/memory-efficient attention: the s x s attention probabilities are not stored")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p.parse_intermixed_args(argv)


def world_size_of(cfg, world_size=None) -> int:
    return world_size or ParallelLayout.world_of(cfg.parallel)


def fail(message: str) -> int:
    """One line on stderr, exit code 2: the user's input is at fault."""
    message = str(message).split("Config search path")[0]  # Hydra appends its search path: noise here
    print(f"estimate: {' '.join(message.split())}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.world_size is not None and args.world_size < 1:
        return fail(f"--world-size {args.world_size} must be >= 1")
    try:
        cfg = compose(args.overrides)
        check_counts(cfg)
    except (HydraException, OmegaConfBaseException, ConfigError) as e:  # unknown preset or key, bad value
        return fail(e)
    world = world_size_of(cfg, args.world_size)
    p, t = cfg.parallel, cfg.train
    if t.rampup_batch_size is not None:  # memory peaks at the largest batch: the final one
        print(f"estimate: train.rampup_batch_size={list(t.rampup_batch_size)}: estimated at the final global batch "
              f"{t.global_batch_size} (the ramp's smaller batches hold fewer micro-batches)", file=sys.stderr)
        t.rampup_batch_size = None
    try:
        dp = ParallelLayout.from_keys({**p, "dp": None}, world).dp
    except LayoutError:
        dp = None  # validate() below names the values
    fill_pipeline = dp is not None and t.global_batch_size % (t.micro_batch_size * dp) != 0
    if fill_pipeline:  # the batch only sets micro-batches in flight: assume enough to fill the pipeline
        print(f"estimate: train.global_batch_size={t.global_batch_size} is not a multiple of micro batch "
              f"{t.micro_batch_size} x dp {dp}; assuming enough micro-batches to fill the pipeline", file=sys.stderr)
        t.global_batch_size = t.micro_batch_size * dp
    try:
        validate(cfg, world)
    except ConfigError as e:
        return fail(f"invalid configuration for world size {world}: {e}")
    model = OmegaConf.to_container(cfg.model, resolve=True)
    try:
        layout = Layout.from_config(cfg.parallel, cfg.train, cfg.optim, world_size=world)
    except LayoutError as e:  # stages of different widths: not estimated
        return fail(e)
    if fill_pipeline:
        layout = dataclasses.replace(layout, num_microbatches=None)
    if args.fused_attention:
        layout = dataclasses.replace(layout, fused_attention=True)
    estimate = estimate_memory(model, layout)
    if args.json:
        print(json.dumps({"model": model, "layout": layout.as_dict(), "world_size": world, "memory": estimate.as_dict()}))
    else:
        print(format_report(model, layout, estimate))
    return 0

