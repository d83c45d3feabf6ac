"""An error every rank raises alike tears the process groups down before it leaves ``pretrain``: left to
interpreter exit, a gloo group's threads may be destroyed still running, and the rank aborts ("terminate
called without an active exception", exit -6) after printing its one-line message, losing its exit code."""

import pytest
import torch.distributed as dist

from megand.training import pretrain as pretrain_module
from megand.training.config import ConfigError
from megand.training.guards import NonFiniteStop
from megand.training.save_failures import SaveFailureStop


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("error", [SaveFailureStop, NonFiniteStop, ConfigError, OSError])
def test_an_error_of_every_rank_leaves_no_process_group(one_rank, monkeypatch, error):
    class FailingTrainer:
        def __init__(self, cfg, adopt_model=None):
            dist.new_group(backend="gloo")  # a group of its own, as the checkpointer has
            raise error("stops here")

    monkeypatch.setattr(pretrain_module, "Trainer", FailingTrainer)
    with pytest.raises(error, match="stops here"):
        pretrain_module.pretrain(cfg=None)
    assert not dist.is_initialized()


def test_a_bug_keeps_its_traceback_and_its_groups(one_rank, monkeypatch):
    # an error one rank alone may raise: its groups stay as they are (tearing one down waits for its queued
    # work, which may need a peer that never joins)
    class BuggyTrainer:
        def __init__(self, cfg, adopt_model=None):
            raise KeyError("a bug")

    monkeypatch.setattr(pretrain_module, "Trainer", BuggyTrainer)
    with pytest.raises(KeyError):
        pretrain_module.pretrain(cfg=None)
    assert dist.is_initialized()
