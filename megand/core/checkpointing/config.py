"""The checkpointer's own configuration (built from the run config by the training package)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None = None  # directory of iter_NNNNNNN/ checkpoints and `latest`
    async_save: bool = False  # write in a background thread after a copy to CPU
    keep_last: int | None = None  # after each save keep only the newest N iter_* directories (None: all)
    timeout_s: float = 3600.0  # how long one collective of a save or load may wait for the other ranks
    local_dir: str | None = None  # the node-local tier's directory (None: no local tier): local_tier.py
    budget_s: float | None = None  # how long one save may take before it counts as failed (None: no limit)
