"""Failed checkpoint saves do not stop training. A save that fails (a file-size limit: EFBIG; a write that
stalls past checkpoint.save_timeout_s) names the path and the error, leaves the previous checkpoint and
`latest` intact, removes its partial files, is reported (console, a metrics.jsonl event) and retried at the
next interval; the run stops with exit code 5 only after checkpoint.max_failed_saves failures in a row (or
when the final save fails). Every fault comes from outside the ranks: RLIMIT_FSIZE set on them
(`ulimit -f`) and lifted mid-run (prlimit), a FIFO where rank 0 writes `latest`."""

import json
import os
import resource
import stat

import pytest

from megand.core.checkpointing import offline
from tests.distributed.torchrun_jobs import Job
from tests.harness import read_metrics, run_pretrain

LIMIT = 48 * 1024  # above metrics.jsonl and the small files, below one rank's tensor file
EXIT_SAVE_FAILED = 5


def limit_file_size():
    # the soft limit (what writes meet); the hard one stays unlimited so that prlimit from outside may lift it
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, resource.RLIM_INFINITY))


def events(run_dir) -> list[dict]:
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [r for r in map(json.loads, f) if r.get("event") == "checkpoint_save_failed"]
    except (FileNotFoundError, ValueError):
        return []


def latest(save) -> str:
    with open(os.path.join(save, "latest")) as f:
        return f.read().strip()


def assert_same_state(a, b) -> None:
    """Every tensor of two checkpoints (model and optimizer state) bit-identical."""
    shapes = offline.tensor_shapes(a, prefix="")
    assert shapes == offline.tensor_shapes(b, prefix="")
    for key in shapes:
        x, y = offline.load_tensors(a, [key], prefix="")[key], offline.load_tensors(b, [key], prefix="")[key]
        assert torch_equal(x, y), key


def torch_equal(x, y) -> bool:
    import torch

    return torch.equal(x, y)


def test_failed_saves_in_a_row_stop_with_their_exit_code(tmp_path):
    save = str(tmp_path / "ckpt")
    common = ["+experiment=tiny_gpt", f"checkpoint.save={save}", f"checkpoint.load={save}", "train.eval_iters=0"]
    run_pretrain(str(tmp_path / "first"), [*common, "train.iters=2"], nproc=2)
    assert latest(save) == "2"

    # every save fails: training goes on past the first failure, and stops after the second in a row
    limited = str(tmp_path / "limited")
    proc = run_pretrain(limited, [*common, "train.iters=8", "checkpoint.interval=1", "checkpoint.max_failed_saves=2"],
                        nproc=2, check=False, preexec_fn=limit_file_size)
    assert proc.returncode == EXIT_SAVE_FAILED, proc.stderr[-3000:]
    line = next(x for x in proc.stderr.splitlines() if x.startswith("megand: checkpoint saves failed"))
    assert "2 consecutive saves failed (checkpoint.max_failed_saves=2)" in line
    assert os.path.join(save, "iter_0000004.tmp") in line
    assert f"file too large: the file-size limit of this process is {LIMIT} bytes (ulimit -f)" in line
    assert "latest still names the previous checkpoint" in line
    assert "Traceback" not in proc.stderr
    assert proc.stdout.count("WARNING: checkpoint save at iteration 3 failed, training continues") == 1
    assert [r["iter"] for r in read_metrics(limited)] == [3, 4]  # it trained on after the first failure
    assert [(e["iter"], e["failed_saves_in_a_row"], e["run_stops"]) for e in events(limited)] == [(3, 1, False),
                                                                                                   (4, 2, True)]
    assert latest(save) == "2"
    assert sorted(os.listdir(save)) == ["iter_0000002", "latest"]  # the partial saves were removed

    # continue_on_error: failures only warn, the final one too; the run finishes (exit 0), `latest` still loads
    proc = run_pretrain(str(tmp_path / "tolerant"), [*common, "train.iters=4", "checkpoint.interval=1",
                                                     "checkpoint.continue_on_error=true"],
                        nproc=2, preexec_fn=limit_file_size)
    assert proc.stdout.count("WARNING: checkpoint save at iteration") == 2  # iterations 3 and 4
    assert "the run ends without it (checkpoint.continue_on_error=true)" in proc.stdout
    assert latest(save) == "2"
    assert sorted(os.listdir(save)) == ["iter_0000002", "latest"]

    # without it, a failed final save stops the run at once (the first failure, below max_failed_saves=3)
    proc = run_pretrain(str(tmp_path / "final"), [*common, "train.iters=3"], nproc=2, check=False,
                        preexec_fn=limit_file_size)
    assert proc.returncode == EXIT_SAVE_FAILED, proc.stderr[-3000:]
    assert "megand: checkpoint saves failed: the final save failed" in proc.stderr
    assert latest(save) == "2"


ITERS = 12
COMMON = ["+experiment=tiny_gpt", "train.eval_iters=0", f"train.iters={ITERS}", "checkpoint.interval=2",
          "checkpoint.max_failed_saves=100"]


@pytest.fixture(scope="module")
def unfaulted(tmp_path_factory):
    root = tmp_path_factory.mktemp("unfaulted")
    run_pretrain(str(root / "run"), [*COMMON, f"checkpoint.save={root / 'ckpt'}"], nproc=2)
    return str(root / "run"), str(root / "ckpt")


def lift_limit_after_first_failure(job, run_dir) -> None:
    """From outside: once a save has failed, give the ranks back an unlimited file size (space returns)."""
    job.wait_for(lambda: events(run_dir))
    for pid in job.ranks().values():
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def check_recovered(run_dir, save, unfaulted) -> None:
    reference_run, reference_save = unfaulted
    failed = events(run_dir)
    assert failed and not any(e["run_stops"] for e in failed)
    assert latest(save) == str(ITERS)
    assert not [n for n in os.listdir(save) if n.endswith((".tmp", ".abandoned"))]  # no partial save left
    for name in os.listdir(save):  # every directory left is complete (files and checksums checked)
        if name.startswith("iter_"):
            offline.tensor_shapes(os.path.join(save, name))
    assert {r["iter"]: r["loss"] for r in read_metrics(run_dir)} == {r["iter"]: r["loss"]
                                                                      for r in read_metrics(reference_run)}
    assert_same_state(save, reference_save)  # the final model and optimizer state: an unfaulted run's


@pytest.mark.parametrize("async_save", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_full_disk_mid_run_training_goes_on(tmp_path, unfaulted, async_save):
    run_dir, save = str(tmp_path / "run"), str(tmp_path / "ckpt")
    job = Job(run_dir, [*COMMON, f"checkpoint.save={save}", f"checkpoint.async_save={str(async_save).lower()}"], 2,
              preexec_fn=limit_file_size)
    lift_limit_after_first_failure(job, run_dir)
    assert job.wait() == 0, job.output[-4000:]
    assert "failed, training continues, the next save is at the next interval" in job.output
    check_recovered(run_dir, save, unfaulted)
    saved = {int(n[5:]) for n in os.listdir(save) if n.startswith("iter_")}
    assert not saved & {e["iter"] for e in events(run_dir)}  # the failed saves left nothing


@pytest.mark.slow  # ~25 s: a save stalls for checkpoint.save_timeout_s
def test_stalled_save_times_out_and_training_goes_on(tmp_path, unfaulted):
    """Rank 0's write of `latest` blocks (a FIFO nobody reads, like a hung filesystem): the save runs over
    checkpoint.save_timeout_s, is abandoned on every rank, and the next saves succeed once the FIFO is gone."""
    run_dir, save = str(tmp_path / "run"), str(tmp_path / "ckpt")
    os.makedirs(save)
    job = Job(run_dir, [*COMMON, f"checkpoint.save={save}", "checkpoint.save_timeout_s=4"], 2)
    job.wait_for(lambda: 0 in job.ranks())
    fifo = os.path.join(save, f"latest.tmp{job.ranks()[0]}")  # files.atomic_write_text's private name
    os.mkfifo(fifo)
    job.wait_for(lambda: events(run_dir))
    os.unlink(fifo)
    assert job.wait() == 0, job.output[-4000:]
    assert "not finished within its budget of 4 s" in events(run_dir)[0]["error"]
    assert not stat.S_ISFIFO(os.lstat(os.path.join(save, "latest")).st_mode)
    check_recovered(run_dir, save, unfaulted)
