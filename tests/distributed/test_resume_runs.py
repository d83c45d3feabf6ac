"""Resuming: one command serves the first launch and every restart (checkpoint.load == checkpoint.save);
a smaller global batch size resumes on indexed data from the data position the checkpoint recorded."""

import os

import numpy as np

from tests.harness import read_metrics, run_pretrain
from tests.unit.data_helpers import write_indexed


def test_same_command_first_launch_and_restarts(tmp_path):
    save = str(tmp_path / "ckpt")
    os.makedirs(save)  # an empty directory, as a job script may create it
    command = ["+experiment=tiny_gpt", f"checkpoint.save={save}", f"checkpoint.load={save}", "train.eval_iters=0"]
    first = run_pretrain(str(tmp_path / "run"), [*command, "train.iters=2"])
    assert "holds no checkpoint yet: starting from scratch" in first.stdout
    second = run_pretrain(str(tmp_path / "run"), [*command, "train.iters=4"])
    assert "loaded checkpoint" in second.stdout and "at iteration 2" in second.stdout
    again = run_pretrain(str(tmp_path / "run"), [*command, "train.iters=4"])  # nothing left to do
    assert "at iteration 4" in again.stdout
    assert [r["iter"] for r in read_metrics(str(tmp_path / "run"))] == [1, 2, 3, 4]


def test_smaller_global_batch_resumes_on_indexed_data(tmp_path):
    rng = np.random.default_rng(0)
    prefix = write_indexed(tmp_path / "corpus", [rng.integers(0, 250, 40) for _ in range(60)])
    save = str(tmp_path / "ckpt")
    common = ["+experiment=tiny_gpt", "data=indexed", f"data.paths=[[1.0,{prefix}]]", "data.split='1000,0,0'",
              "train.eval_iters=0", f"checkpoint.save={save}", f"data.cache_dir={tmp_path}/cache"]
    run_pretrain(str(tmp_path / "a"), [*common, "train.iters=4", "train.global_batch_size=8"])
    run_pretrain(str(tmp_path / "b"), [*common, "train.iters=6", "train.global_batch_size=4",
                                       f"checkpoint.load={save}"])
    resumed = read_metrics(str(tmp_path / "b"))
    assert [r["iter"] for r in resumed] == [5, 6]
    assert [r["consumed_samples"] for r in resumed] == [36, 40]  # 4 x 8, then 4 more per step
