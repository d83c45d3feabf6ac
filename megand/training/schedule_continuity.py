"""A resume must not re-warm a decayed model: loading a checkpoint saved in its WSD schedule's decay under a
schedule that puts the same step at a higher learning rate (typically: extending a WSD run by raising
``train.iters`` after its decay) is refused, naming the last checkpoint of the stable phase to extend from.
"""

from __future__ import annotations

import os
import re

from omegaconf import OmegaConf

from megand.core.optimizer.lr_schedule import LRSchedule
from megand.training.config import ConfigError

_REL = 1e-6


def schedule_of(cfg) -> LRSchedule:
    o = cfg.optim
    return LRSchedule(o.lr, o.min_lr, o.warmup_iters, o.get("decay_iters") or cfg.train.iters, o.schedule,
                      o.get("decay_style", "1-sqrt"), o.get("decay_fraction", 0.2), o.get("decay_start"))


def stable_checkpoints(parent: str, last_stable_step: int) -> list[str]:
    """``iter_N`` directories in ``parent`` with N within the stable phase."""
    found = []
    for name in sorted(os.listdir(parent)) if os.path.isdir(parent) else []:
        m = re.fullmatch(r"iter_(\d+)", name)
        if m and 0 < int(m.group(1)) <= last_stable_step:
            found.append(os.path.join(parent, name))
    return found


def check_no_rewarm(cfg, checkpoint_path: str, steps: int, saved_config: str | None = None,
                    save_dir: str | None = None) -> None:
    """ConfigError when this run's schedule raises the learning rate of a checkpoint saved in its decay.
    ``steps``: the optimizer steps the checkpoint has taken (the schedule's position). ``saved_config``: the
    checkpoint's run config (YAML) when it is not ``checkpoint_path/config.yaml`` (a state of the node-local
    tier); ``save_dir``: the shared save directory of such a state, where the checkpoints to extend from
    are (default: next to ``checkpoint_path``)."""
    if steps <= 0:
        return
    if saved_config is None:
        path = os.path.join(checkpoint_path, "config.yaml")
        if not os.path.isfile(path):
            return
        with open(path) as f:
            saved_config = f.read()
    saved_cfg = OmegaConf.create(saved_config)
    try:
        saved = schedule_of(saved_cfg)
    except Exception:  # noqa: BLE001 - a checkpoint of an older schema: nothing to compare with
        return
    new = schedule_of(cfg)
    was, now = saved(steps), new(steps)
    # WSD only: its recipe extends a run by relaunching with more steps, which is right from its stable phase
    # only; a cosine or linear run resumed with more steps stretches its one decay (an accepted practice)
    in_decay = saved.kind == "wsd" and steps > saved.decay_start and was < saved.lr * (1 - _REL)
    if not in_decay or now <= was * (1 + _REL):
        return
    stable = stable_checkpoints(save_dir or os.path.dirname(os.path.normpath(checkpoint_path)), saved.decay_start)
    hint = (f"extend from a checkpoint of the stable phase instead, e.g. checkpoint.load={stable[-1]} with a new "
            f"checkpoint.save and run_dir" if stable else
            "no checkpoint of its stable phase is next to it to extend from")
    what = (f"checkpoint.load={checkpoint_path}" if save_dir is None else
            f"checkpoint.load={save_dir} (its newest state, in the node-local tier: {checkpoint_path})")
    error = ConfigError(f"{what} was saved at step {steps}, in the decay of its schedule "
                        f"(lr {was:.3e} < optim.lr {saved.lr:.3e}, decay from step {saved.decay_start}); this run's "
                        f"schedule puts that step at lr {now:.3e}, which would re-warm a decayed model: {hint}")
    error.every_rank = True  # every rank reads the same files and raises alike
    raise error
