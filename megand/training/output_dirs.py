"""The run's output directories are checked before any work: a run must not train for hours and then
find that it cannot keep what it trained."""

from __future__ import annotations

import os
import tempfile

from megand.training.config import ConfigError
from megand.training.resume import load_path


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
    """``run_dir``, ``checkpoint.save`` and ``checkpoint.local_dir`` (when set) are directories this process can
    write into."""
    check_writable("run_dir", str(cfg.run_dir))
    if cfg.checkpoint.save:
        check_writable("checkpoint.save", str(cfg.checkpoint.save))
    if cfg.checkpoint.get("local_dir"):  # on every node: each rank checks its own node's directory
        check_writable("checkpoint.local_dir", str(cfg.checkpoint.local_dir))


def check_run_dir_reuse(cfg) -> None:
    """A run never truncates or appends to another run's logs: a ``run_dir`` that already holds a
    ``metrics.jsonl`` is accepted only when this run resumes the run that wrote it, i.e. loads the latest
    checkpoint of its own save directory (``checkpoint.load`` = ``checkpoint.save``, the requeue idiom). A
    branch (a cooldown from one ``iter_N``, another run's checkpoint) or a fresh run is refused."""
    run_dir = str(cfg.run_dir)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(metrics) or os.path.getsize(metrics) == 0:
        return
    path, _ = load_path(cfg.checkpoint)
    save = cfg.checkpoint.save
    if path and save and os.path.abspath(path) == os.path.abspath(str(save)):
        return
    raise ConfigError(f"run_dir={run_dir} already holds another run's logs ({metrics}): this run would overwrite "
                      f"them; give it a new run_dir, or resume that run with checkpoint.load and checkpoint.save "
                      f"both set to its checkpoint directory")
