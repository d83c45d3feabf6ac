"""The collective timeout reaches the process groups, and a checkpoint save has a budget of its own."""

import os
from datetime import timedelta

import pytest
import torch.distributed as dist

from megand.training.config import compose
from tests.harness import read_metrics, run_pretrain


class Joined(Exception):
    """Raised by the stand-in for init_process_group: the launch has gone as far as the test needs."""


def test_collective_timeout_reaches_init_process_group(monkeypatch):
    from megand.training.pretrain import Trainer

    seen = {}

    def init_process_group(backend, **kwargs):
        seen.update(kwargs, backend=backend)
        raise Joined

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    with pytest.raises(Joined):
        Trainer(compose(["+experiment=tiny_gpt", "train.collective_timeout_s=42"]))
    # a minute after the watchdog's limit: the watchdog reports where the ranks are before the backend aborts
    assert seen["timeout"] == timedelta(seconds=42 + 60)


SLOW_DISK = '''
import os, time

_fsync = os.fsync


def slow_fsync(fd):  # every flush to the disk takes 1.2 s: a slow network filesystem
    time.sleep(1.2)
    return _fsync(fd)


os.fsync = slow_fsync
'''


def test_slow_synchronous_save_does_not_trip_the_hang_watchdog(tmp_path):
    """A save of several seconds on a slow disk, under a 3 s collective timeout: the save has its own budget
    (``checkpoint.save_timeout_s``, an hour by default), so the run finishes and publishes its checkpoint."""
    slow = tmp_path / "slow_disk"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(SLOW_DISK)  # loaded by each rank's interpreter at start-up
    path = os.pathsep.join([str(slow), os.environ.get("PYTHONPATH", "")])
    proc = run_pretrain(tmp_path / "run", ["+experiment=tiny_gpt", "train.iters=2", "train.eval_iters=0",
                                           "train.collective_timeout_s=3", f"checkpoint.save={tmp_path / 'ckpt'}",
                                           "checkpoint.interval=1"],
                        extra_env={"PYTHONPATH": path}, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hang detected" not in proc.stderr
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "2"
    assert len(read_metrics(tmp_path / "run")) == 2
