"""In-process trainers for the data-parallel tests (run inside megand.tools.spawn.run_distributed ranks)."""

import tempfile

import torch

from megand.training.config import compose


def build_trainer(overrides, experiment="tiny_llama"):
    """A Trainer of this rank (the process group already exists), writing under a private temp dir."""
    from megand.training.pretrain import Trainer

    run_dir = tempfile.mkdtemp(prefix="megand_dp_")
    cfg = compose([f"+experiment={experiment}", f"run_dir={run_dir}", *overrides])
    return Trainer(cfg)


def step(trainer):
    return trainer.step()


def snapshot_params(trainer):
    trainer.ddp.finish_param_sync()
    return {n: p.detach().clone() for n, p in trainer.named_params}


def snapshot_state(trainer):
    return [t.clone() for t in trainer.optimizer.state_tensors()]


def state_bytes(trainer) -> int:
    return sum(t.numel() * t.element_size() for t in trainer.optimizer.state_tensors())


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))
