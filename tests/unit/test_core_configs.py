"""The run config becomes core's typed configs once, at start-up: the builders take only those, every key
of the ``parallel``, ``optim`` and ``checkpoint`` sections reaches a core config (or is listed with what
reads it), and a key no core config reads is an error naming it."""

import copy
import inspect
from dataclasses import fields

import pytest
import torch
from omegaconf import OmegaConf

from megand.core.optimizer.config import OptimizerConfig
from megand.core.parallel_layout import ParallelLayout
from megand.training import config as schema
from megand.training import core_configs as core_configs_module
from megand.training.config import ConfigError, compose, validate
from megand.training.core_configs import READ_ELSEWHERE, core_configs, split_section
from tests.unit.test_trainer_wandb import one_process_world  # noqa: F401

TINY = ["+experiment=tiny_gpt", "run_dir=/tmp/unused"]
CPU = torch.device("cpu")

# a schema key -> (overrides it needs to be valid, a value other than its default) where the type alone does
# not give one (strings, nulls, keys that depend on others); others: a flipped bool, int + 1, float x 2
OTHER_VALUE = {
    "parallel.dp": ({}, 2),
    "parallel.dp_microbatches": ({"parallel.dp": 2}, [3, 1]),  # uneven shares of the global batch  # on the world it names (_core_configs): dp=null on one rank is dp=1
    "parallel.ep": ({"parallel.dp": 2}, 2),
    "parallel.vpp": ({"parallel.pp": 2}, 2),
    "parallel.pp_schedule": ({"parallel.pp": 2}, "zb1p"),
    "parallel.order": ({}, "dp-tp-cp-pp"),
    "parallel.dp_shard": ({}, 1),
    "parallel.etp": ({}, 1),
    "parallel.pipeline_layout": ({"parallel.pp": 2}, [1, 3]),
    "parallel.cp_comm": ({}, "a2a"),
    "optim.name": ({}, "muon"),
    "optim.schedule": ({}, "wsd"),
    "optim.decay_style": ({}, "linear"),
    "optim.decay_iters": ({}, 50),
    "optim.decay_start": ({}, 20),
    "optim.sharding": ({}, "optim"),
    "checkpoint.save": ({}, "/tmp/unused_ckpt"),
    "checkpoint.keep_last": ({}, 2),
    "checkpoint.local_dir": ({}, "/tmp/unused_local"),
}


def _other(default):
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, float):
        return default * 2 if default else 0.5
    return None


SECTIONS = {"parallel": schema.ParallelConfig, "optim": schema.OptimConfig, "checkpoint": schema.CheckpointConfig}
SCHEMA_KEYS = [(section, f.name) for section, cls in SECTIONS.items() for f in fields(cls)]


@pytest.fixture(scope="module")
def tiny():
    return compose(TINY)


def _core_configs(cfg):
    """The core configs of ``cfg`` on the world its ``parallel`` keys name (a null dp counted as 1)."""
    return core_configs(cfg, CPU, ParallelLayout.world_of(cfg.parallel))


def _with(cfg, values):
    cfg = copy.deepcopy(cfg)
    for key, value in values.items():
        OmegaConf.update(cfg, key, value)
    return cfg


@pytest.mark.parametrize("section,name", SCHEMA_KEYS, ids=[f"{s}.{n}" for s, n in SCHEMA_KEYS])
def test_every_schema_key_reaches_a_core_config(tiny, section, name):
    """A key added to the schema but read by no core config fails here (unless READ_ELSEWHERE names its
    reader): changing it must change what the start-up builds from."""
    if name in READ_ELSEWHERE.get(section, {}):
        return
    key = f"{section}.{name}"
    needs, value = OTHER_VALUE.get(key, ({}, _other(getattr(SECTIONS[section](), name))))
    assert value is not None, f"{key}: add a non-default value to OTHER_VALUE"
    before = _core_configs(_with(tiny, needs))
    after = _core_configs(_with(tiny, {**needs, key: value}))
    assert before != after, f"{key}={value} changes no core config: it would be silently ignored"


def test_read_elsewhere_names_only_schema_keys():
    for section, keys in READ_ELSEWHERE.items():
        assert set(keys) <= {f.name for f in fields(SECTIONS[section])}, section


def test_a_key_no_core_config_reads_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"^optim.lr_typo, optim.zz: read by no core config \(OptimizerConfig\)"):
        split_section("optim", {"lr": 1e-3, "zz": 1, "lr_typo": 2}, OptimizerConfig)
    # and through the run config: the schema refuses the key before any work
    with pytest.raises(ConfigError, match="lr_typo"):
        validate(compose(TINY + ["+optim.lr_typo=1"]), 1)


def test_the_builders_take_typed_configs_not_the_run_config():
    from megand.training import pretrain

    for builder in (pretrain.build_topology, pretrain.build_model, pretrain.build_model_and_engine,
                    pretrain.build_datasets):
        assert "cfg" not in inspect.signature(builder).parameters, builder.__name__


def test_start_up_reads_the_run_config_into_core_configs_once(one_process_world, monkeypatch):  # noqa: F811
    from megand.training import pretrain

    calls = []

    def counted(cfg, device, world_size):
        calls.append(device)
        return core_configs_module.core_configs(cfg, device, world_size)

    monkeypatch.setattr(pretrain, "core_configs", counted)
    trainer = pretrain.Trainer(compose(["+experiment=tiny_gpt", "train.iters=1", "train.eval_iters=0",
                                        f"run_dir={one_process_world / 'run'}"]))
    assert len(calls) == 1
    configs = trainer.configs
    assert trainer.model_cfg is configs.model and trainer.optimizer.cfg is configs.optimizer
    assert trainer.ddp.config is configs.data_parallel
    trainer.writer.close()
