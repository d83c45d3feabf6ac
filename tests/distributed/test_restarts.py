"""In-job restart and the hang watchdog, with the launcher's own restarts (torchrun --max-restarts):
a rank killed mid-run, or stopped (SIGSTOP) so that the others hang in a collective, makes the job
restart every worker; they resume by themselves (checkpoint.load == checkpoint.save) from the newest
checkpoint published before the fault and finish with the losses of an uninterrupted run. Only the
steps since that checkpoint are computed again: at most checkpoint.interval with synchronous saves;
an asynchronous save still being written when the fault comes is lost with the steps it would have kept."""

import os
import re
import signal
import time

import pytest

from tests.distributed.torchrun_jobs import Job, metric_iters
from tests.harness import read_metrics, run_pretrain

ITERS, INTERVAL = 24, 4
COMMON = ["+experiment=tiny_gpt", "train.eval_iters=0", f"train.iters={ITERS}"]


def checkpointed(save, *extra):
    return [*COMMON, f"checkpoint.save={save}", f"checkpoint.load={save}", f"checkpoint.interval={INTERVAL}", *extra]


def final_losses(run_dir) -> dict[int, float]:
    """iteration -> loss of the last time it was computed (a restart recomputes some)."""
    return {r["iter"]: r["loss"] for r in read_metrics(run_dir)}


def published(save) -> int:
    """The iteration `latest` names (0 before the first checkpoint)."""
    try:
        with open(os.path.join(save, "latest")) as f:
            return int(f.read())
    except (FileNotFoundError, ValueError):
        return 0


def restart_point(output: str, iters: list[int]) -> tuple[int, int]:
    """(the iteration the one restart resumed from, the last iteration logged before it), checking that
    the log is exactly 1..last followed by resumed+1..ITERS: no step skipped, none repeated otherwise."""
    loaded = [int(n) for n in re.findall(r"loaded checkpoint \S+ at iteration (\d+)", output)]
    assert len(loaded) == 1, output[-4000:]
    resumed = loaded[0]
    last = len(iters) - (ITERS - resumed)
    assert last >= resumed and iters == [*range(1, last + 1), *range(resumed + 1, ITERS + 1)], (resumed, iters)
    return resumed, last


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("uninterrupted"))
    run_pretrain(run_dir, COMMON, nproc=2)
    return final_losses(run_dir)


def test_killed_rank_restarts_and_matches_uninterrupted(tmp_path, uninterrupted):
    run_dir, save = str(tmp_path / "run"), str(tmp_path / "ckpt")
    job = Job(run_dir, checkpointed(save, "checkpoint.async_save=true", "checkpoint.keep_last=2"), 2,
              launcher_args=["--max-restarts=1"])
    # killed right after an (asynchronous) save is published: the restart recomputes the steps since
    job.wait_for(lambda: published(save) >= 2 * INTERVAL)
    newest = published(save)
    os.kill(job.ranks()[1], signal.SIGKILL)
    assert job.wait() == 0, job.output[-4000:]
    resumed, _ = restart_point(job.output, metric_iters(run_dir))
    assert resumed >= newest  # nothing published before the kill is lost
    assert final_losses(run_dir) == uninterrupted  # bit for bit, every iteration
    # retention with asynchronous saves: the newest two, `latest` among them
    assert sorted(os.listdir(save)) == [f"iter_{ITERS - INTERVAL:07d}", f"iter_{ITERS:07d}", "latest"]


@pytest.mark.slow  # 27 s; the watchdog runs in the default suite in test_runtime_timeouts, restarts here above
def test_stopped_rank_trips_the_watchdog_then_the_job_resumes(tmp_path, uninterrupted):
    run_dir, save = str(tmp_path / "run"), str(tmp_path / "ckpt")
    timeout = 8
    job = Job(run_dir, checkpointed(save, f"train.collective_timeout_s={timeout}"), 2,
              launcher_args=["--max-restarts=1"])
    job.wait_for(lambda: len(metric_iters(run_dir)) >= 6)
    stopped = job.ranks()[1]
    os.kill(stopped, signal.SIGSTOP)
    at, newest = time.monotonic(), published(save)
    job.wait_for(lambda: "hang detected" in job.output, timeout=timeout + 60)
    seen = next(t for t, line in job.lines if "hang detected" in line)
    assert seen - at <= timeout + 30
    message = next(line for _, line in job.lines if "hang detected" in line)
    assert "rank 0: hang detected" in message and "phase '" in message and "in iteration" in message
    assert "Thread 0x" in job.output or "Current thread" in job.output  # the stacks of all threads
    os.kill(stopped, signal.SIGCONT)
    assert job.wait() == 0, job.output[-4000:]
    resumed, last = restart_point(job.output, metric_iters(run_dir))
    assert resumed >= newest and last - resumed <= INTERVAL
    assert final_losses(run_dir) == uninterrupted


@pytest.mark.slow
def test_killed_rank_restarts_with_two_agents(tmp_path, uninterrupted):
    run_dir, save = str(tmp_path / "run"), str(tmp_path / "ckpt")
    job = Job(run_dir, checkpointed(save), 1, launcher_args=["--max-restarts=1"], nnodes=2)
    job.wait_for(lambda: published(save) >= 2 * INTERVAL)
    newest = published(save)
    os.kill(job.ranks()[1], signal.SIGKILL)  # the worker of the second "node"
    assert job.wait() == 0, job.output[-4000:]
    resumed, last = restart_point(job.output, metric_iters(run_dir))
    assert resumed >= newest and last - resumed <= INTERVAL
    assert final_losses(run_dir) == uninterrupted
