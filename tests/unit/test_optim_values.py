"""Every optimizer and schedule value is checked before any work, in one line naming the values; each
optimizer record checks its own (Muon also its AdamW fallback's)."""

import os
import subprocess
import sys

import pytest

from megand.training.config import ConfigError, compose, validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("overrides, named", [
    (["optim.lr=-1"], "optim.lr=-1.0 must be > 0"),
    (["optim.lr=0"], "optim.lr=0.0 must be > 0"),
    (["optim.min_lr=0.01"], "optim.min_lr=0.01 must be between 0 and optim.lr=0.001"),
    (["optim.min_lr=-1e-5"], "optim.min_lr=-1e-05 must be between 0 and optim.lr=0.001"),
    (["optim.weight_decay=-0.1"], "optim.weight_decay=-0.1 must be >= 0"),
    (["optim.clip_grad=-1"], "optim.clip_grad=-1.0 must be >= 0 (0: no clipping)"),
    (["optim.beta1=1.0"], "optim.beta1=1.0 must be in [0, 1)"),
    (["optim.beta2=-0.5"], "optim.beta2=-0.5 must be in [0, 1)"),
    (["optim.eps=0"], "optim.eps=0.0 must be > 0"),
    (["optim.initial_loss_scale=0"], "optim.initial_loss_scale=0.0 must be > 0"),
    (["optim.hysteresis=0"], "optim.hysteresis=0 must be >= 1"),
    (["optim.warmup_iters=-1"], "optim.warmup_iters=-1 must be >= 0"),
    (["optim.decay_iters=4", "optim.warmup_iters=6"], "optim.warmup_iters=6 ends after the decay (end 4"),
    (["optim.schedule=wsd", "optim.decay_fraction=1.5"], "optim.decay_fraction=1.5 must be between 0 and 1"),
    (["optim.schedule=wsd", "optim.decay_start=1"], "optim.decay_start=1 must lie between optim.warmup_iters=2"),
    (["optim.schedule=wsd", "optim.decay_fraction=0.9"], "optim.schedule=wsd decays from step 1"),
    (["optim.name=muon", "optim.muon_momentum=1.0"], "optim.muon_momentum=1.0 must be in [0, 1)"),
    (["optim.name=muon", "optim.muon_ns_steps=0"], "optim.muon_ns_steps=0 must be >= 1"),
    (["optim.name=muon", "optim.beta2=1.0"], "optim.beta2=1.0 must be in [0, 1)"),  # its AdamW fallback's
    (["optim.name=lion", "optim.beta1=1.5"], "optim.beta1=1.5 must be in [0, 1]"),
])
def test_bad_optimizer_value_is_named(overrides, named):
    with pytest.raises(ConfigError) as e:
        validate(compose(["+experiment=tiny_gpt", *overrides]), world_size=1)
    assert named in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("overrides", [
    [], ["optim.clip_grad=0"], ["optim.min_lr=0"], ["optim.name=lion", "optim.beta1=1.0"],
    ["optim.warmup_iters=50"],  # longer than the run: the run only warms up
    ["optim.schedule=constant", "optim.decay_iters=1"],
])
def test_good_values_pass(overrides):
    validate(compose(["+experiment=tiny_gpt", *overrides]), world_size=1)


def test_negative_lr_run_is_one_line_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "+experiment=tiny_gpt",
                           "optim.lr=-1", f"run_dir={tmp_path / 'run'}"], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip() == "megand: invalid configuration: optim.lr=-1.0 must be > 0"
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
