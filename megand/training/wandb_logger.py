"""Weights & Biases logging that can never break training.

One run per training job, created only on the logging rank, offline by default (no network, no
account: sync later with ``wandb sync <run_dir>/wandb/offline-run-*``). The run id is exposed so the
training loop can store it in checkpoints and pass it back as ``resume_id`` to continue the same run.

Any wandb failure (not installed, init error, log error) warns once and turns the logger into a no-op.
"""

import struct
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional, Union


def _plain(config: Any) -> Any:
    """An OmegaConf node resolved to plain containers; anything else unchanged."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:
        return config
    if isinstance(config, (DictConfig, ListConfig)):
        return OmegaConf.to_container(config, resolve=True)
    return config


class WandbLogger:
    """``cfg`` is the ``logging.wandb`` group: ``enabled``, ``project``, ``name``, ``mode`` (default offline).

    On ranks where ``enabled_on_this_rank`` is False, or when ``cfg.enabled`` is False, every method is a
    silent no-op, so the training loop calls the logger unconditionally.
    """

    def __init__(self, cfg: Optional[Mapping[str, Any]], run_dir: Union[str, Path], full_config: Mapping,
                 enabled_on_this_rank: bool, resume_id: Optional[str] = None):
        self._run = None
        self._failed = False
        cfg = cfg or {}
        if not (enabled_on_this_rank and cfg.get("enabled", True)):
            return
        try:
            import wandb  # optional at run time: a missing package only disables this logger

            # The run's files go to <run_dir>/wandb/; the config is logged fully resolved.
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            self._run = wandb.init(
                project=cfg.get("project") or "megand",
                name=cfg.get("name"),
                mode=cfg.get("mode") or "offline",
                dir=str(run_dir),
                config=_plain(full_config),
                id=resume_id,
                resume="allow" if resume_id else None,
                reinit="create_new",  # never reuse or finish a run someone else started in-process
                settings=wandb.Settings(silent=True),
            )
        except Exception as e:  # noqa: BLE001 - whatever wandb raises, training goes on
            self._disable(f"wandb could not start ({type(e).__name__}: {e})")

    def _disable(self, reason: str) -> None:
        if not self._failed:
            warnings.warn(f"{reason}; wandb logging is disabled for this run", RuntimeWarning, stacklevel=3)
        self._failed = True
        self._run = None

    @property
    def active(self) -> bool:
        return self._run is not None

    @property
    def run_id(self) -> Optional[str]:
        """The run id to store in checkpoints (None when inactive)."""
        return self._run.id if self._run is not None else None

    @property
    def run_path(self) -> Optional[Path]:
        """The run's own directory (``<run_dir>/wandb/<offline->run-<date>-<id>``), None when inactive."""
        return Path(self._run.dir).parent if self._run is not None else None

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log ``metrics`` at iteration ``step``; None values (e.g. no MFU on an unknown GPU) are dropped."""
        if self._run is None:
            return
        try:
            self._run.log({k: v for k, v in metrics.items() if v is not None}, step=int(step))
        except Exception as e:  # noqa: BLE001
            self._disable(f"wandb log failed ({type(e).__name__}: {e})")

    def alert(self, title: str, text: str) -> None:
        """A wandb alert (an email or Slack message where the project has them set up; recorded offline)."""
        if self._run is None:
            return
        try:
            self._run.alert(title=title, text=text, level="WARN")
        except Exception as e:  # noqa: BLE001
            self._disable(f"wandb alert failed ({type(e).__name__}: {e})")

    def finish(self) -> None:
        if self._run is None:
            return
        run, self._run = self._run, None
        try:
            run.finish()
        except Exception as e:  # noqa: BLE001
            self._disable(f"wandb finish failed ({type(e).__name__}: {e})")


# --- reading an offline run back (tests, and checking a run before syncing it) --------------------

_BLOCK = 32768        # the .wandb file is a LevelDB-style log: 32 KiB blocks of chunked records
_FILE_HEADER = 7      # b":W&B" + magic (2 bytes) + version (1 byte)
_CHUNK_HEADER = 7     # crc32 (4) + length (2) + type (1): 1 full, 2 first, 3 middle, 4 last


def _records(data: bytes):
    pos, pending = _FILE_HEADER, b""
    while pos + _CHUNK_HEADER <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _CHUNK_HEADER:  # block trailer padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _CHUNK_HEADER])
        chunk = data[pos + _CHUNK_HEADER:pos + _CHUNK_HEADER + length]
        pos += _CHUNK_HEADER + length
        if kind == 0:  # zero padding: end of the written data
            break
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk


def read_offline_history(run_path: Union[str, Path], timeout: float = 30.0) -> list:
    """The history rows (one dict per logged step, values decoded from JSON) of a finished offline run.

    wandb's service process writes the transaction log asynchronously: ``finish()`` can return before
    the file is flushed, so this waits (up to ``timeout`` seconds) for the run's final ``exit`` record.
    """
    import json
    import time

    from wandb.proto import wandb_internal_pb2

    (wandb_file,) = Path(run_path).glob("*.wandb")
    deadline = time.monotonic() + timeout
    while True:
        rows, finished = [], False
        for raw in _records(wandb_file.read_bytes()):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            kind = record.WhichOneof("record_type")
            if kind == "history":
                rows.append({(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                             for item in record.history.item})
            finished |= kind == "exit"
        if finished or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)
