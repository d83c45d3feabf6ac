"""WandbLogger: offline run with the logged history; every kind of wandb failure is a warned no-op."""

import sys
import types
import warnings

import pytest

from megand.training.wandb_logger import WandbLogger, read_offline_history

CFG = {"enabled": True, "project": "megand-test", "name": "unit", "mode": "offline"}
FULL = {"model": {"arch": "llama", "num_layers": 2}, "train": {"iters": 3}, "run_dir": "x"}


@pytest.fixture
def wandb_home(tmp_path, monkeypatch):
    """Keep wandb's own config/cache/data directories inside the test's temporary directory."""
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "home" / var.lower()))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    return tmp_path


def test_offline_run_records_every_step(wandb_home):
    run_dir = wandb_home / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the logger itself must not warn here
        logger = WandbLogger(CFG, run_dir, FULL, enabled_on_this_rank=True)
        assert logger.active and logger.run_id
        for it in (10, 20, 30):
            logger.log({"loss": 1.0 / it, "lr": 3e-4, "mfu": None}, step=it)
        path = logger.run_path
        logger.finish()
    assert path.parent == run_dir / "wandb"
    rows = read_offline_history(path)
    assert [r["_step"] for r in rows] == [10, 20, 30]
    assert all({"loss", "lr"} <= set(r) and "mfu" not in r for r in rows)
    assert rows[-1]["loss"] == pytest.approx(1 / 30)
    logger.log({"loss": 0.0}, step=40)  # after finish: a no-op, not an error


def test_resume_keeps_run_id(wandb_home):
    first = WandbLogger(CFG, wandb_home / "run", FULL, enabled_on_this_rank=True)
    run_id = first.run_id
    first.finish()
    again = WandbLogger(CFG, wandb_home / "run", FULL, enabled_on_this_rank=True, resume_id=run_id)
    assert again.run_id == run_id
    again.finish()


def test_disabled_rank_and_disabled_config_are_silent(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for logger in (WandbLogger(CFG, tmp_path, FULL, enabled_on_this_rank=False),
                       WandbLogger({**CFG, "enabled": False}, tmp_path, FULL, enabled_on_this_rank=True)):
            logger.log({"loss": 1.0}, step=1)
            logger.finish()
            assert not logger.active and logger.run_id is None
    assert not (tmp_path / "wandb").exists()


def _assert_one_warning_then_noop(make_logger):
    with pytest.warns(RuntimeWarning) as record:
        logger = make_logger()
        for step in range(3):
            logger.log({"loss": 1.0}, step=step)
        logger.finish()
    assert len(record) == 1
    assert not logger.active and logger.run_id is None


def test_missing_wandb_is_a_noop_with_one_warning(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    _assert_one_warning_then_noop(lambda: WandbLogger(CFG, tmp_path, FULL, enabled_on_this_rank=True))


def _fake_wandb(init):
    module = types.ModuleType("wandb")
    module.init = init
    module.Settings = lambda **kw: kw
    return module


def test_init_error_is_a_noop_with_one_warning(tmp_path, monkeypatch):
    def init(**kwargs):
        raise RuntimeError("no network")
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(init))
    _assert_one_warning_then_noop(lambda: WandbLogger(CFG, tmp_path, FULL, enabled_on_this_rank=True))


def test_log_error_is_a_noop_with_one_warning(tmp_path, monkeypatch):
    class BrokenRun:
        id = "broken"
        dir = str(tmp_path)

        def log(self, *args, **kwargs):
            raise OSError("disk full")

        def finish(self):
            raise AssertionError("finish must not be called after the logger disabled itself")

    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(lambda **kw: BrokenRun()))
    _assert_one_warning_then_noop(lambda: WandbLogger(CFG, tmp_path, FULL, enabled_on_this_rank=True))


def test_omegaconf_config_is_resolved(tmp_path, monkeypatch):
    import omegaconf

    seen = {}

    class Run:
        id, dir = "r", str(tmp_path)

        def finish(self):
            pass

    def init(**kwargs):
        seen.update(kwargs)
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(init))
    cfg = omegaconf.OmegaConf.create({"a": 2, "b": "${a}"})
    WandbLogger(omegaconf.OmegaConf.create(CFG), tmp_path, cfg, enabled_on_this_rank=True).finish()
    assert seen["config"] == {"a": 2, "b": 2} and seen["mode"] == "offline"
