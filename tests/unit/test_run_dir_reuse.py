"""A run never truncates or appends to another run's logs, and its summary counts only its own steps:
the commands as a user types them, one after another in the same run_dir."""

import hashlib
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(tmp_path, *overrides):
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "+experiment=tiny_gpt", "model.num_layers=1",
           "train.iters=4", "train.eval_iters=0", f"run_dir={tmp_path / 'run'}", *overrides]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def summary(proc):
    return json.loads(proc.stdout.strip().splitlines()[-1])["summary"]


def test_reused_run_dir_resumes_or_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = run(tmp_path, f"checkpoint.save={ckpt}", f"checkpoint.load={ckpt}", "checkpoint.interval=2")
    assert first.returncode == 0, first.stderr[-3000:]
    metrics, config = tmp_path / "run" / "metrics.jsonl", tmp_path / "run" / "config.yaml"
    before = digest(metrics), digest(config)

    # a new run in the same run_dir, and a cooldown branched from iter 2 into it: refused, logs untouched
    for overrides in ([], [f"checkpoint.load={ckpt}/iter_0000002", "optim.schedule=wsd", "optim.decay_start=2",
                           f"checkpoint.save={tmp_path / 'cooldown'}"]):
        proc = run(tmp_path, *overrides)
        assert proc.returncode == 2, proc.stderr[-3000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and f"run_dir={tmp_path / 'run'} already holds another run's logs ({metrics})" \
            in lines[0], proc.stderr
        assert (digest(metrics), digest(config)) == before

    # the same command again (a requeue after the end): resumes, trains nothing, and says so
    again = run(tmp_path, f"checkpoint.save={ckpt}", f"checkpoint.load={ckpt}", "checkpoint.interval=2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert summary(again)["iterations"] == 0 and summary(again)["tokens"] == 0
    # extended by two steps: this run's 2 steps and 2 x 8 x 32 tokens, appended to the same logs
    longer = run(tmp_path, f"checkpoint.save={ckpt}", f"checkpoint.load={ckpt}", "checkpoint.interval=2",
                 "train.iters=6")
    assert longer.returncode == 0, longer.stderr[-3000:]
    s = summary(longer)
    assert (s["iterations"], s["final_iteration"], s["tokens"]) == (2, 6, 2 * 8 * 32)
    assert "training done: 2 iterations (resumed at iteration 4, now at 6)" in longer.stdout
    iters = [r["iter"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
    assert iters == [1, 2, 3, 4, 5, 6]
