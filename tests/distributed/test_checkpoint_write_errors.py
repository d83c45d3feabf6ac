"""A save that fails (file-size limit: EFBIG) names the path and the OS error, leaves the previous
checkpoint and `latest` intact, and stops the run (or only warns with checkpoint.continue_on_error).
The limit is set from outside: RLIMIT_FSIZE on the rank processes (`ulimit -f`)."""

import os
import resource

from tests.harness import read_metrics, run_pretrain

LIMIT = 48 * 1024  # above metrics.jsonl and the small files, below one rank's tensor file


def limit_file_size():
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))


def test_save_over_file_size_limit_keeps_previous_checkpoint(tmp_path):
    save = str(tmp_path / "ckpt")
    common = ["+experiment=tiny_gpt", f"checkpoint.save={save}", f"checkpoint.load={save}", "train.eval_iters=0"]
    run_pretrain(str(tmp_path / "first"), [*common, "train.iters=2"], nproc=2)
    with open(os.path.join(save, "latest")) as f:
        assert f.read().strip() == "2"

    limited = str(tmp_path / "limited")
    proc = run_pretrain(limited, [*common, "train.iters=4"], nproc=2, check=False, preexec_fn=limit_file_size)
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = next(x for x in proc.stderr.splitlines() if x.startswith("megand: cannot save checkpoint"))
    assert os.path.join(save, "iter_0000004.tmp") in line
    assert f"file too large: the file-size limit of this process is {LIMIT} bytes (ulimit -f)" in line
    assert "latest still names the previous checkpoint" in line
    assert "Traceback" not in proc.stderr
    assert [r["iter"] for r in read_metrics(limited)] == [3, 4]  # it trained, then failed at the save
    with open(os.path.join(save, "latest")) as f:
        assert f.read().strip() == "2"
    assert sorted(os.listdir(save)) == ["iter_0000002", "latest"]  # the partial save was removed

    # continue_on_error: the failure only warns; the run finishes (exit 0) and `latest` still loads
    proc = run_pretrain(str(tmp_path / "tolerant"), [*common, "train.iters=4", "checkpoint.interval=1",
                                                     "checkpoint.continue_on_error=true"],
                        nproc=2, preexec_fn=limit_file_size)
    assert proc.stdout.count("WARNING: checkpoint save failed, training continues") == 2  # iterations 3 and 4
    assert "file too large" in proc.stdout
    with open(os.path.join(save, "latest")) as f:
        assert f.read().strip() == "2"
    assert sorted(os.listdir(save)) == ["iter_0000002", "latest"]
