"""Checks shared by the Hugging Face family tests: a checkpoint imported from transformers' files trains
its first step with transformers' own loss."""

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from megand.core.checkpointing import offline
from tests.harness import read_metrics, run_pretrain


def first_step_loss_equals_transformers(name: str, theirs, ckpt: str, nproc: int, overrides, tmp_path) -> None:
    """Train one step from ``ckpt`` with no model key (the checkpoint's model) on ``nproc`` ranks; its loss
    equals ``theirs`` (the transformers model) on the same batch within 1e-5 relative."""
    run_dir = str(tmp_path / "run")
    proc = run_pretrain(run_dir, [f"checkpoint.load={ckpt}", "train.iters=1", "train.eval_iters=0", *overrides],
                        nproc=nproc)
    assert "model from checkpoint" in proc.stdout
    loss = read_metrics(run_dir)[0]["loss"]

    from megand.training.core_configs import dataset_plan
    from megand.training.pretrain import build_datasets

    cfg = OmegaConf.load(f"{run_dir}/config.yaml")
    train, _ = build_datasets(dataset_plan(cfg), offline.single_process_topology())
    tokens = torch.stack([torch.as_tensor(train[i], dtype=torch.long) for i in range(cfg.train.global_batch_size)])
    with torch.no_grad():
        logits = theirs(input_ids=tokens[:, :-1]).logits
    expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).item()
    print(f"{name}: first-step loss {loss:.8f}, transformers {expected:.8f}")
    assert abs(loss - expected) / expected <= 1e-5, (loss, expected)
