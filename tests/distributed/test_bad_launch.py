"""Bad input and dead peers under a launcher: a configuration error is one line and exit code 2 before any
worker starts (so ``--max-restarts`` never retries it), and a rank that is killed leaves one line on the
survivors, not a traceback. Faults come from outside: bad values on the command line, SIGKILL."""

import os
import signal
import subprocess
import sys

import pytest

from megand.tools.spawn import free_port
from tests.distributed.torchrun_jobs import ROOT, Job, metric_iters

LAUNCH = (os.path.join(ROOT, "tools", "launch.py"),)


def launch(tmp_path, *overrides, nproc=2, launcher_args=("--max-restarts=3",)):
    cmd = [sys.executable, *LAUNCH, "--standalone", f"--nproc-per-node={nproc}", *launcher_args,
           os.path.join(ROOT, "pretrain_gpt.py"), "+experiment=tiny_gpt", f"run_dir={tmp_path / 'run'}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


@pytest.mark.parametrize("override, named", [
    ("optim.lr=-1", "optim.lr=-1.0 must be > 0"),
    ("parallel.tp=3", "world size 2 is not divisible by tp*pp*cp = 3*1*1 = 3"),
    ("optim.nope=1", "Could not override 'optim.nope'"),
])
def test_config_error_is_one_line_exit_2_and_never_spawned(tmp_path, override, named):
    proc = launch(tmp_path, override)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megand: invalid configuration:") and named in lines[0], proc.stderr
    assert proc.stdout == ""  # no worker ran: nothing to retry
    assert not (tmp_path / "run").exists()


def test_a_killed_peer_is_one_line_on_the_survivor(tmp_path):
    job = Job(str(tmp_path / "run"), ["+experiment=tiny_gpt", "train.iters=100000", "train.log_interval=1",
                                      "train.eval_interval=0", "train.eval_iters=0"], nproc=2, launcher=LAUNCH)
    job.wait_for(lambda: len(metric_iters(job.run_dir)) >= 2 and 1 in job.ranks())
    os.kill(job.ranks()[1], signal.SIGKILL)
    code = job.wait(timeout=300)
    out = job.output
    assert code != 0, out[-3000:]
    assert "Traceback" not in out, out[-5000:]
    assert "megand: rank 0 stopped: a peer rank failed or was killed" in out, out[-3000:]
    assert "launch: pretrain_gpt.py failed: rank 1 exited with code -9 (killed by a signal)" in out, out[-3000:]
