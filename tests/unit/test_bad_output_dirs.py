"""A run whose outputs cannot be written fails before any work (not at its first save), in one line
naming the key and the path, leaving what is there as it was."""

import pytest

from tests.harness import run_pretrain

UNWRITABLE = "/sys"  # read-only even for root, who ignores permission bits


@pytest.mark.parametrize("case", ["save_read_only", "save_is_a_file", "run_dir_under_a_file"])
def test_unwritable_output_fails_before_any_work(tmp_path, case):
    blocker = tmp_path / "blocker"
    blocker.write_text("user data")
    run_dir = tmp_path / "run"
    if case == "save_read_only":
        overrides, named = [f"checkpoint.save={UNWRITABLE}"], f"checkpoint.save={UNWRITABLE}: not writable"
    elif case == "save_is_a_file":
        overrides, named = [f"checkpoint.save={blocker}"], f"checkpoint.save={blocker}: exists and is not a directory"
    else:
        run_dir = blocker / "run"
        overrides, named = [], f"run_dir={run_dir}: not writable (Not a directory)"
    proc = run_pretrain(run_dir, ["+experiment=tiny_gpt", "train.iters=2", *overrides], check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0], proc.stderr[-3000:]
    assert "iteration" not in proc.stdout  # no step was taken
    assert blocker.read_text() == "user data"
