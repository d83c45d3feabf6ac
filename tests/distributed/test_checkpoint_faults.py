"""Faults: a stop signal saves and exits 0; a job killed mid-save leaves the previous checkpoint
as `latest`, and it loads; a checkpoint of another model shape fails before training."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.harness import ranks_env, read_metrics, run_pretrain

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def launch(run_dir, overrides, nproc, extra_env=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(ROOT, "pretrain_gpt.py"), f"run_dir={run_dir}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **ranks_env(nproc), **(extra_env or {})}
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def kill_job(proc):
    """SIGKILL torchrun and its workers (each worker runs in a session of its own)."""
    try:
        workers = children(proc.pid)
    except OSError:
        workers = []
    for pid in [*workers, proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_for(predicate, proc, timeout=300):
    deadline = time.time() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"job ended early ({proc.returncode}):\n{proc.stdout.read()[-4000:]}")
        if time.time() > deadline:
            kill_job(proc)
            raise AssertionError("timed out")
        time.sleep(0.2)


def metric_lines(run_dir):
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


@pytest.mark.slow
def test_sigterm_saves_and_exits_0_then_other_shape_fails_before_training(tmp_path):
    run_dir, save = str(tmp_path / "run"), str(tmp_path / "ckpt")
    proc = launch(run_dir, ["+experiment=tiny_gpt", "parallel.tp=2", "train.iters=500", f"checkpoint.save={save}"], 4)
    wait_for(lambda: metric_lines(run_dir) >= 3, proc)
    workers = children(proc.pid)
    assert len(workers) == 4, workers
    os.kill(max(workers), signal.SIGTERM)  # one worker only (not the logging rank): all ranks must agree
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        kill_job(proc)
    assert proc.returncode == 0, out[-4000:]
    assert "stop signal received" in out
    stopped = len(read_metrics(run_dir))
    assert 3 <= stopped < 500
    with open(os.path.join(save, "latest")) as f:
        assert int(f.read()) == stopped
    assert os.path.isfile(os.path.join(save, f"iter_{stopped:07d}", ".metadata"))

    bad = run_pretrain(str(tmp_path / "bad"), ["+experiment=tiny_gpt", "parallel.tp=2", "model.ffn_hidden_size=128",
                                               f"checkpoint.load={save}"], nproc=2, check=False)
    assert bad.returncode != 0
    # the checkpoint's model is compared key by key before anything is built: one line naming the key
    assert "model.ffn_hidden_size: checkpoint 256, this run 128" in bad.stderr
    assert not os.path.exists(os.path.join(str(tmp_path / "bad"), "metrics.jsonl"))  # failed before training


def freeze_during_a_save(save, proc, first=4, timeout=300):
    """Stop (SIGSTOP) every worker while a save of iteration >= ``first`` is still ``iter_N.tmp``; returns N.
    A save that completes between the look and the stop is let go (SIGCONT) and the next one is tried."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"job ended before a save could be caught:\n{proc.stdout.read()[-4000:]}")
        names = os.listdir(save) if os.path.isdir(save) else []
        pending = [n for n in names if n.startswith("iter_") and n.endswith(".tmp") and int(n[5:12]) >= first]
        if pending:
            workers = children(proc.pid)
            for pid in workers:
                os.kill(pid, signal.SIGSTOP)
            name = pending[0]
            if os.path.isdir(os.path.join(save, name)) and not os.path.exists(os.path.join(save, name[:-4])):
                return int(name[5:12])
            for pid in workers:
                os.kill(pid, signal.SIGCONT)
        time.sleep(0.001)
    kill_job(proc)
    raise AssertionError("no save caught in progress")


def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
    save = str(tmp_path / "ckpt")
    common = ["+experiment=tiny_llama", "parallel.tp=2", "train.iters=40", "train.eval_iters=0",
              f"checkpoint.save={save}", "checkpoint.interval=2"]
    killed_dir = str(tmp_path / "killed")
    proc = launch(killed_dir, common, 4)
    caught = freeze_during_a_save(save, proc)  # every rank frozen mid-save of iteration `caught`
    kill_job(proc)
    proc.communicate(timeout=60)
    with open(os.path.join(save, "latest")) as f:
        assert int(f.read()) == caught - 2
    assert os.path.isdir(os.path.join(save, f"iter_{caught:07d}.tmp"))
    assert not os.path.exists(os.path.join(save, f"iter_{caught:07d}"))
    killed = read_metrics(killed_dir)
    assert killed[-1]["iter"] == caught

    # resume from `latest` into the same directory, now saving asynchronously, until two steps further
    resumed_dir = str(tmp_path / "resumed")
    proc = run_pretrain(resumed_dir, [*common, f"checkpoint.load={save}", "checkpoint.async_save=true",
                                      f"train.exit_interval={caught + 2}"], nproc=4)
    assert "loaded checkpoint" in proc.stdout and f"at iteration {caught - 2}" in proc.stdout
    resumed = read_metrics(resumed_dir)
    assert [r["iter"] for r in resumed] == [caught - 1, caught, caught + 1, caught + 2]
    assert [r["loss"] for r in resumed[:2]] == [r["loss"] for r in killed[-2:]]  # bit-identical
    with open(os.path.join(save, "latest")) as f:
        assert int(f.read()) == caught + 2
    names = os.listdir(save)
    assert not [n for n in names if n.endswith(".tmp")], names  # the crashed save's leftovers were replaced
    assert {f"iter_{caught:07d}", f"iter_{caught + 2:07d}"} <= set(names)
