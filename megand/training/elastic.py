"""Elastic continuation: a run that resumes its own checkpoint on a different number of ranks.

Under torchrun's elastic rendezvous (``--nnodes=MIN:MAX``) a lost node makes the agents restart the
workers on the nodes left, and a node that comes back makes them restart on more: the same command at a
new world size, resuming from ``latest`` (``checkpoint.load`` = ``checkpoint.save``). The rule of what
such a restart may change:

- **may change: the data-parallel width.** ``dp = world size / (tp*pp*cp)`` (``parallel.dp`` null) and so
  the micro-batches of each replica, ``global_batch_size / (micro_batch_size * dp)``: fewer nodes
  accumulate more micro-batches into the same global batch. The samples of every step and their order do
  not depend on dp (megand/training/batches.py), nor does the learning rate of a step, so the run goes on
  where it was; only fp32 summation order changes (the correctness protocol's layout tolerances).
- **may not change:** the batch (``train.global_batch_size``, ``micro_batch_size``,
  ``rampup_batch_size``), ``train.seed`` and ``precision``, the data (``data.*``), the optimizer and its
  learning-rate schedule (``optim.*`` but its sharding level), and the model (checked on every load).
  Changing one of them is a new run: load the checkpoint into a new ``checkpoint.save`` and ``run_dir``.
- **fixed per width, so refused:** ``parallel.dp`` set (it cannot follow the world size) and
  ``parallel.dp_microbatches`` (one share per replica of one width).

:func:`check_continuation` applies it before any work: to a run that loads the latest checkpoint of its
own save directory, written at another world size with the same model-parallel layout (``parallel.tp/pp/
cp/vpp/ep/etp``, ``pp_schedule``, ``pipeline_layout``): an elastic restart repeats its command, so those stay.
A run that changes one of them in place is a deliberate reshard (megand loads any layout exactly), as it
always was, and is not an elastic continuation. The new world size's own divisibility (by tp*pp*cp, the
global batch by micro-batch x dp, the schedule's micro-batch rule) is :func:`validate`'s, which names it.
"""

from __future__ import annotations

import os

from omegaconf import OmegaConf

from megand.core.checkpointing import files
from megand.core.parallel_layout import ParallelLayout
from megand.training.config import ConfigError
from megand.training.resume import load_path

# the keys an elastic restart keeps from the checkpoint it continues (a group name: all its keys)
FIXED_KEYS = ("train.global_batch_size", "train.micro_batch_size", "train.rampup_batch_size", "train.seed",
              "train.precision", "data", "optim")
# the model-parallel layout: an elastic restart keeps it (the same command); a run that changes it reshards
LAYOUT_KEYS = ("tp", "pp", "cp", "vpp", "ep", "etp", "pp_schedule", "pipeline_layout")
# keys of a fixed group that may change all the same: where state lives, not the arithmetic
FREE_KEYS = ("optim.sharding", "optim.reshard_after_forward", "optim.overlap_grad_reduce", "optim.overlap_param_gather",
             "data.cache_dir")


def _flat(value, prefix: str) -> dict:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}.{k}"))
        return out
    return {prefix: value}


def _select(container: dict, key: str):
    node = container
    for part in key.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def fixed_values(container: dict) -> dict:
    """``key -> value`` of :data:`FIXED_KEYS` (groups flattened, :data:`FREE_KEYS` left out) of a resolved
    config as plain containers."""
    values = {}
    for key in FIXED_KEYS:
        values.update(_flat(_select(container, key), key))
    return {k: v for k, v in values.items() if k not in FREE_KEYS}


def continuation_error(saved: dict, current: dict, saved_world: int, world_size: int) -> str | None:
    """Why this run (config ``current``, ``world_size`` ranks) cannot continue elastically a checkpoint of
    config ``saved`` written at ``saved_world`` ranks; None if it can."""
    where = f"an elastic restart at world size {world_size} (the checkpoint's: {saved_world})"
    p = current.get("parallel", {})
    if p.get("dp") is not None:
        return (f"{where}: parallel.dp={p['dp']} is fixed; leave parallel.dp null so that it follows the world size "
                f"(world size / (tp*pp*cp))")
    if p.get("dp_microbatches") is not None:
        return (f"{where}: parallel.dp_microbatches={list(p['dp_microbatches'])} gives one share per replica of one "
                f"data-parallel width; leave it null for a run whose width changes")
    old, new = fixed_values(saved), fixed_values(current)
    changed = [f"{k}={new.get(k)!r} (checkpoint: {old.get(k)!r})" for k in sorted(set(old) | set(new))
               if old.get(k) != new.get(k) and k in old]
    if changed:
        return (f"{where} may change only the data-parallel width, but {'; '.join(changed[:3])}"
                f"{f' and {len(changed) - 3} more' if len(changed) > 3 else ''}; to change them, load the checkpoint "
                f"into a new checkpoint.save and run_dir")
    return None


def check_continuation(cfg, world_size: int) -> str | None:
    """Before any work: ConfigError when this run resumes its own latest checkpoint (``checkpoint.load`` =
    ``checkpoint.save``) written at another world size and breaks the rule above; else the one-line notice
    of the continuation (None when it is not one)."""
    path, _ = load_path(cfg.checkpoint)
    save = cfg.checkpoint.save
    if not (path and save and os.path.abspath(path) == os.path.abspath(str(save))):
        return None
    try:
        iter_dir = files.resolve(path)
        common = files.read_common(iter_dir)
    except files.CheckpointError:
        return None  # the loader reports it, naming the file
    saved_world = (common.get("layout") or {}).get("world_size")
    config_file = os.path.join(iter_dir, files.CONFIG)
    if saved_world in (None, world_size) or not os.path.isfile(config_file):
        return None
    saved = OmegaConf.to_container(OmegaConf.load(config_file), resolve=True)
    current = OmegaConf.to_container(cfg, resolve=True)
    if any(saved.get("parallel", {}).get(k) != current.get("parallel", {}).get(k) for k in LAYOUT_KEYS):
        return None  # a reshard in place, not an elastic restart
    error = continuation_error(saved, current, saved_world, world_size)
    if error:
        raise ConfigError(error)
    t, layout = cfg.train, common["layout"]
    model_ranks = ParallelLayout.world_of({**saved["parallel"], "dp": None})  # tp·pp·cp, or the stages' widths·cp
    dp = world_size // model_ranks
    if not dp or world_size % model_ranks:
        return None  # validate() names what the new world size breaks
    per_replica = lambda d: t.global_batch_size // (t.micro_batch_size * d)  # noqa: E731
    return (f" elastic restart from {iter_dir}: world size {saved_world} -> {world_size}, dp {layout['dp']} -> {dp}, "
            f"micro-batches per replica {per_replica(layout['dp'])} -> {per_replica(dp)}, the same global batch "
            f"{t.global_batch_size}")
