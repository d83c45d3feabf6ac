"""The rule of an elastic restart (megand/training/elastic.py): resuming its own checkpoint at another world
size may change the data-parallel width only, and is refused before any work, in one line naming the
values, when it changes anything else or fixes dp. The restart itself: tests/distributed/test_elastic.py."""

import os

import pytest
import torch
from omegaconf import OmegaConf

from megand.core.checkpointing import files
from megand.training.config import ConfigError, compose
from megand.training.elastic import check_continuation


def saved_run(tmp_path, world_size=4, dp=4, overrides=()):
    """A save directory whose latest checkpoint (files only) was written at ``world_size`` ranks."""
    save = tmp_path / "ckpt"
    iter_dir = save / files.iter_dir_name(6)
    os.makedirs(iter_dir)
    (iter_dir / files.METADATA).write_bytes(b"")
    torch.save({"format": files.FORMAT, "iteration": 6, "layout": {"tp": 1, "pp": 1, "cp": 1, "dp": dp, "vpp": None,
                "order": "tp-cp-dp-pp", "world_size": world_size}}, iter_dir / files.COMMON)
    (iter_dir / files.CONFIG).write_text(OmegaConf.to_yaml(run_config(save, overrides)))
    (save / files.LATEST).write_text("6\n")
    return save


def run_config(save, overrides=()):
    return compose(["+experiment=tiny_llama", f"checkpoint.save={save}", f"checkpoint.load={save}", *overrides])


def test_elastic_restart_changes_dp_only(tmp_path):
    save = saved_run(tmp_path)
    # fewer ranks: dp 4 -> 2, two micro-batches per replica instead of one, the same global batch of 8
    notice = check_continuation(run_config(save), world_size=2)
    assert "world size 4 -> 2, dp 4 -> 2, micro-batches per replica 1 -> 2, the same global batch 8" in notice
    assert check_continuation(run_config(save, ["optim.sharding=optim"]), 2)  # where state lives may change
    assert check_continuation(run_config(save), 4) is None  # the same world size: an ordinary resume
    assert check_continuation(run_config(save, [f"checkpoint.save={tmp_path}/new"]), 2) is None  # a branch
    # a new model-parallel layout in place is a deliberate reshard (as before elastic runs existed), not refused
    assert check_continuation(run_config(save, ["parallel.tp=2"]), 2) is None
    assert check_continuation(run_config(save, ["parallel.pp=2", "train.seed=7"]), 2) is None

    for overrides, named in ((["train.global_batch_size=16"], "train.global_batch_size=16 (checkpoint: 8)"),
                             (["optim.lr=0.01"], "optim.lr=0.01 (checkpoint: 0.001)"),
                             (["train.seed=7"], "train.seed=7 (checkpoint:"),
                             (["parallel.dp=2"], "parallel.dp=2 is fixed"),
                             (["parallel.dp_microbatches=[1,3]"], "parallel.dp_microbatches=[1, 3]")):
        with pytest.raises(ConfigError) as e:
            check_continuation(run_config(save, overrides), 2)
        message = str(e.value)
        assert "\n" not in message and named in message and "world size 2 (the checkpoint's: 4)" in message, message


def test_elastic_launch_is_valid_at_every_node_count():
    from torch.distributed.run import parse_args

    from megand.tools.launch import config_error, is_elastic

    def launch(nnodes, *overrides):
        return parse_args([f"--nnodes={nnodes}", "--nproc-per-node=2", "pretrain_gpt.py", "+experiment=tiny_llama",
                           *overrides])

    assert is_elastic(launch("1:2")) and not is_elastic(launch("2")) and not is_elastic(launch("2:2"))
    assert config_error(launch("1:2")) is None  # dp 2 or 4, one micro-batch of 2 per replica at most 4
    assert config_error(launch("1:2", "train.global_batch_size=12")) == (
        "megand: invalid configuration: at --nnodes=1:2 x 2 = world size 4: train.global_batch_size=12 is not "
        "divisible by train.micro_batch_size=2 x dp=4 = 8")
    assert config_error(launch("1:2", "parallel.dp=2")).startswith(
        "megand: invalid configuration: at --nnodes=1:2 x 2 = world size 4: parallel.dp=2 but world size 4")
