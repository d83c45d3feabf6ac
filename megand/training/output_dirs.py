"""The run's output directories are checked before any work: a run must not train for hours and then
find that it cannot keep what it trained."""

from __future__ import annotations

import os
import tempfile

from megand.training.config import ConfigError


def check_writable(key: str, path: str) -> None:
    """Create ``path`` if missing and write (then remove) a probe file in it; ConfigError naming the key."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{key}={path}: exists and is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".megand-write-check-", dir=path)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"{key}={path}: not writable ({e.strerror or e})") from None


def check_output_dirs(cfg) -> None:
    """``run_dir`` and ``checkpoint.save`` (when set) are directories this process can write into."""
    check_writable("run_dir", str(cfg.run_dir))
    if cfg.checkpoint.save:
        check_writable("checkpoint.save", str(cfg.checkpoint.save))
