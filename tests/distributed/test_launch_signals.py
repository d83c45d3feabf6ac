"""tools/launch.py (torchrun's arguments): a stop signal to the launcher (SIGTERM from a scheduler, or
Ctrl-C to its process group) makes the workers save, and the whole command exits 0."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.harness import ranks_env, read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start(run_dir, save, nproc=2):
    cmd = [sys.executable, os.path.join(ROOT, "tools", "launch.py"), "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(ROOT, "pretrain_gpt.py"), "+experiment=tiny_gpt", "train.iters=500",
           f"run_dir={run_dir}", f"checkpoint.save={save}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": ROOT, **ranks_env(nproc)}
    # a session of its own, as a job started from a terminal: its process group is what Ctrl-C reaches
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def wait_for_steps(proc, run_dir, steps, timeout=300):
    deadline = time.time() + timeout
    while not (os.path.exists(os.path.join(run_dir, "metrics.jsonl")) and len(read_metrics(run_dir)) >= steps):
        if proc.poll() is not None or time.time() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"no {steps} steps ({proc.poll()}):\n{proc.communicate()[0][-4000:]}")
        time.sleep(0.2)


@pytest.mark.parametrize("how", ["sigterm_to_launcher", "ctrl_c_to_process_group"])
def test_stop_signal_saves_and_the_command_exits_0(tmp_path, how):
    run_dir, save = str(tmp_path / "run"), str(tmp_path / "ckpt")
    proc = start(run_dir, save)
    wait_for_steps(proc, run_dir, 2)
    if how == "sigterm_to_launcher":
        os.kill(proc.pid, signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-4000:]
    assert "stop signal received" in out and "Traceback" not in out, out[-4000:]
    stopped = len(read_metrics(run_dir))
    assert 2 <= stopped < 500
    with open(os.path.join(save, "latest")) as f:
        assert int(f.read()) == stopped
