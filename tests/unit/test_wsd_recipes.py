"""The WSD recipes do what their names say, as commands: extending continues at the peak from a stable
checkpoint (extending from the decayed end is refused, naming the stable checkpoint to use), and a cooldown
branches into its own checkpoint and run directories."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WSD = ["+experiment=tiny_gpt", "model.num_layers=1", "train.eval_iters=0", "optim.schedule=wsd",
       "optim.decay_fraction=0.2", "optim.decay_style=linear", "checkpoint.interval=4"]


def run(cwd, *overrides):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *WSD, *overrides],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def lrs(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["iter"]: r["lr"] for r in map(json.loads, f) if "lr" in r}


def test_extend_and_cooldown(tmp_path):
    local = ("checkpoint.local_dir=local", "checkpoint.local_interval=5")  # the node-local tier holds step 10 too
    first = run(tmp_path, "train.iters=10", "checkpoint.save=ckpt", "checkpoint.load=ckpt", "run_dir=runs/stable", *local)
    assert first.returncode == 0, first.stderr[-3000:]
    peak = lrs(tmp_path / "runs/stable")[8]
    assert lrs(tmp_path / "runs/stable")[10] < peak  # decayed after step 8 = 10 - round(0.2 x 10)

    # "extending" by relaunching with more steps from the decayed end: refused, naming the stable checkpoint
    rewarm = run(tmp_path, "train.iters=20", "checkpoint.save=ckpt", "checkpoint.load=ckpt", "run_dir=runs/stable")
    assert rewarm.returncode == 2, rewarm.stderr[-3000:]
    lines = rewarm.stderr.strip().splitlines()
    assert len(lines) == 1 and "would re-warm a decayed model" in lines[0] and "checkpoint.load=ckpt/iter_0000008" \
        in lines[0], rewarm.stderr
    # the same relaunch restoring from the node-local tier (which never reads the shared tier's config): refused alike
    rewarm = run(tmp_path, "train.iters=20", "checkpoint.save=ckpt", "checkpoint.load=ckpt", "run_dir=runs/stable", *local)
    assert rewarm.returncode == 2, rewarm.stderr[-3000:]
    lines = rewarm.stderr.strip().splitlines()
    assert len(lines) == 1 and "in the node-local tier: local/iter_0000010" in lines[0] and \
        "would re-warm a decayed model" in lines[0] and "checkpoint.load=ckpt/iter_0000008" in lines[0], rewarm.stderr

    # extending from the stable checkpoint: the peak goes on until the new decay (step 16), then decays
    extend = run(tmp_path, "train.iters=20", "checkpoint.load=ckpt/iter_0000008", "checkpoint.save=ckpt_extended",
                 "run_dir=runs/extended")
    assert extend.returncode == 0, extend.stderr[-3000:]
    lr = lrs(tmp_path / "runs/extended")
    assert all(lr[i] == peak for i in range(9, 17)) and lr[20] < lr[17] < peak

    # a cooldown from step 4, in its own directories: the stable run's logs and checkpoints are untouched
    stable_logs = (tmp_path / "runs/stable/metrics.jsonl").read_bytes()
    cooldown = run(tmp_path, "checkpoint.load=ckpt/iter_0000004", "optim.decay_start=4", "train.iters=6",
                   "checkpoint.save=ckpt_cooldown_4", "run_dir=runs/cooldown_4")
    assert cooldown.returncode == 0, cooldown.stderr[-3000:]
    lr = lrs(tmp_path / "runs/cooldown_4")
    assert sorted(lr) == [5, 6] and lr[5] < peak and lr[6] < lr[5]
    assert (tmp_path / "runs/stable/metrics.jsonl").read_bytes() == stable_logs
    assert (tmp_path / "ckpt_cooldown_4/latest").exists()
