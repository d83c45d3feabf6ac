"""Faults: a stop signal saves and exits 0; a job killed mid-save leaves the previous checkpoint
as `latest`, and it loads; a checkpoint of another model shape fails before training."""

import os
import signal
import subprocess
import sys
import time

from tests.harness import read_metrics, run_pretrain

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def launch(run_dir, overrides, nproc, extra_env=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(ROOT, "pretrain_gpt.py"), f"run_dir={run_dir}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(extra_env or {})}
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
    assert "cannot load checkpoint" in bad.stderr
    assert "layers.0.mlp.fc1.weight: expected shape (128, 64), checkpoint has (256, 64)" in bad.stderr
    assert not os.path.exists(os.path.join(str(tmp_path / "bad"), "metrics.jsonl"))  # failed before training


def rank_of(pid) -> int:
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    return int(env[b"RANK"])


def freeze_publisher_mid_save(proc, save, publisher):
    """Stop the publishing rank (SIGSTOP) while a save after the first published one is in progress:
    ``iter_N.tmp`` exists and ``iter_N`` does not. Returns N. A save caught too late (already renamed)
    is let go (SIGCONT) and the next one is tried."""
    published = None
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"job ended before a save could be interrupted ({proc.returncode})")
        try:
            names = os.listdir(save)
        except FileNotFoundError:
            names = []
        if published is None and "latest" in names:
            with open(os.path.join(save, "latest")) as f:
                published = int(f.read())
        in_progress = [int(n[5:12]) for n in names if n.startswith("iter_") and n.endswith(".tmp")]
        if published is not None and in_progress and max(in_progress) > published:
            os.kill(publisher, signal.SIGSTOP)
            iteration = max(in_progress)
            if not os.path.exists(os.path.join(save, f"iter_{iteration:07d}")):
                return iteration
            os.kill(publisher, signal.SIGCONT)  # it had already renamed: wait for the next save
            published = iteration
        time.sleep(0.001)
    kill_job(proc)
    raise AssertionError("timed out waiting for a save to interrupt")


def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
    """The job is frozen and killed from outside while a save is being written: `latest` still names the
    previous checkpoint, which resumes bit-identically."""
    save = str(tmp_path / "ckpt")
    common = ["+experiment=tiny_llama", "parallel.tp=2", "train.iters=20", f"checkpoint.save={save}",
              "checkpoint.interval=2"]
    killed_dir = str(tmp_path / "killed")
    proc = launch(killed_dir, common, 4)
    wait_for(lambda: len(children(proc.pid)) == 4, proc)
    publisher = next(pid for pid in children(proc.pid) if rank_of(pid) == 0)  # rank 0 renames and writes `latest`
    interrupted = freeze_publisher_mid_save(proc, save, publisher)
    kill_job(proc)
    proc.communicate(timeout=60)
    with open(os.path.join(save, "latest")) as f:
        previous = int(f.read())
    assert previous == interrupted - 2
    assert os.path.isdir(os.path.join(save, f"iter_{interrupted:07d}.tmp"))
    assert not os.path.exists(os.path.join(save, f"iter_{interrupted:07d}"))
    killed = read_metrics(killed_dir)
    assert [r["iter"] for r in killed][:interrupted] == list(range(1, interrupted + 1))

    # resume from `latest` into the same directory, now saving asynchronously
    resumed_dir = str(tmp_path / "resumed")
    proc = run_pretrain(resumed_dir, [*common, f"checkpoint.load={save}", "checkpoint.async_save=true"], nproc=4)
    assert "loaded checkpoint" in proc.stdout and f"iteration {previous}" in proc.stdout
    resumed = read_metrics(resumed_dir)
    assert [r["iter"] for r in resumed] == list(range(previous + 1, 21))
    assert [r["loss"] for r in resumed[:2]] == [r["loss"] for r in killed[previous: previous + 2]]  # bit-identical
    with open(os.path.join(save, "latest")) as f:
        assert f.read().strip() == "20"
    assert not any(n.endswith(".tmp") for n in os.listdir(save))  # the interrupted save was cleaned up
