"""Trainer: a resumed run continues the same wandb run id; the run ends with a readable and a JSON summary."""

import json

import pytest
import torch.distributed as dist

from megand.training.config import compose

DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def one_process_world(tmp_path, monkeypatch):
    """``init_distributed`` makes a one-process world and sets the torchrun variables: undo both after."""
    for name in DIST_ENV + ("WANDB_MODE",):
        monkeypatch.delenv(name, raising=False)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "home" / var.lower()))
    import megand.training.peak as peak
    monkeypatch.setattr(peak, "measure_matmul_flops", lambda *a, **k: 50e9)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # not the machine's measured peak
    yield tmp_path
    if dist.is_initialized():
        dist.destroy_process_group()


def test_resumed_trainer_continues_the_wandb_run(one_process_world, capsys):
    from megand.training.pretrain import Trainer
    from megand.training.wandb_logger import read_offline_history

    overrides = ["+experiment=tiny_gpt", "model.num_layers=1", "train.iters=2", "train.eval_iters=1",
                 "logging.wandb.enabled=true", f"run_dir={one_process_world / 'run'}",
                 f"checkpoint.save={one_process_world / 'ckpt'}", f"checkpoint.load={one_process_world / 'ckpt'}"]
    first = Trainer(compose(overrides))
    first.run()
    run_id = first.wandb_run_id
    assert run_id and first.wandb.run_id is None  # finished
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-2].startswith(" training done: 2 iterations, 512 tokens") and "best val loss" in out[-2]
    assert f"checkpoints: {one_process_world / 'ckpt'}" in out[-2]
    summary = json.loads(out[-1])["summary"]
    assert summary["tokens"] == 512 and summary["wandb_run_id"] == run_id and summary["best_val_loss"] > 0

    # a resume (the same run_dir, its own checkpoint) takes the stored id back from the checkpoint
    resumed = Trainer(compose(overrides + ["train.iters=3"]))
    assert resumed.iteration == 2 and resumed.wandb.run_id == run_id
    resumed.run()
    out = capsys.readouterr().out.strip().splitlines()
    # the summary counts this run's one step, not the checkpoint's two
    assert out[-2].startswith(" training done: 1 iterations (resumed at iteration 2, now at 3), 256 tokens"), out[-2]
    assert json.loads(out[-1])["summary"]["iterations"] == 1
    runs = sorted((one_process_world / "run" / "wandb").glob("offline-run-*"))
    # (wandb appends -1 to a second run directory made within the same second)
    assert len(runs) == 2 and all(p.name.endswith(run_id) or p.name.endswith(f"{run_id}-1") for p in runs)
    assert [r["_step"] for r in read_offline_history(runs[-1]) if "loss" in r] == [3]
