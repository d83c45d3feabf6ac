"""Which checkpoint a run starts from: ``checkpoint.load``, or nothing yet when the job saves there.

``checkpoint.load`` equal to ``checkpoint.save`` is the requeue idiom: one job script serves the first
launch and every restart. While that directory holds no checkpoint (missing, empty, or only partial
``.tmp`` saves of a job that died in its first save) the run starts fresh. Any other missing or
incomplete load path stays an error, raised before any work by the checkpoint loader.
"""

from __future__ import annotations

import os

from megand.core.checkpointing.files import LATEST, METADATA


def holds_no_checkpoint(path: str) -> bool:
    """True when ``path`` has no ``latest`` file and no complete ``iter_*`` directory."""
    if not os.path.isdir(path):
        return True
    if os.path.exists(os.path.join(path, LATEST)):
        return False
    return not any(name.startswith("iter_") and not name.endswith(".tmp")
                   and os.path.isfile(os.path.join(path, name, METADATA)) for name in os.listdir(path))


def load_path(checkpoint_cfg) -> tuple[str | None, str | None]:
    """``(path to load or None, a one-line notice or None)``."""
    load, save = checkpoint_cfg.load, checkpoint_cfg.save
    if not load:
        return None, None
    if resumes_itself(checkpoint_cfg) and holds_no_checkpoint(load):
        return None, (f" checkpoint.load={load} is checkpoint.save and holds no checkpoint yet: "
                      f"starting from scratch")
    return load, None


def resumes_itself(checkpoint_cfg) -> bool:
    """The requeue idiom: the run loads from its own save directory (so its node-local tier is its own too)."""
    load, save = checkpoint_cfg.load, checkpoint_cfg.save
    return bool(load and save) and os.path.abspath(load) == os.path.abspath(save)


def open_local_tier(cfg):
    """Collective, before the model exists: ``(tier, choice, notes)``: the node-local tier (None without
    ``checkpoint.local_dir``) and, when this run resumes itself, the local state it starts from (None: the
    shared tier's, if any; the rule is LocalTier.choose's) with the lines saying why newer local states
    were passed over."""
    from megand.training.core_configs import checkpoint_config

    c = checkpoint_config(cfg)
    if not c.local_dir:
        return None, None, []
    from datetime import timedelta

    from megand.core.checkpointing.local_tier import LocalTier

    tier = LocalTier(c.local_dir, os.path.abspath(c.save), timedelta(seconds=c.timeout_s))
    if not resumes_itself(cfg.checkpoint):
        return tier, None, []
    choice, notes = tier.choose(c.save)
    return tier, choice, notes
