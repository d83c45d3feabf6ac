"""Auto-resume: checkpoint.load equal to checkpoint.save starts fresh while it holds no checkpoint."""

import os
from types import SimpleNamespace

from megand.training.resume import load_path


def cfg(load, save):
    return SimpleNamespace(load=load, save=save)


def test_load_equal_to_save_without_checkpoint_starts_fresh(tmp_path):
    save = str(tmp_path / "ckpt")
    path, notice = load_path(cfg(save, save))  # missing
    assert path is None and "holds no checkpoint yet: starting from scratch" in notice
    os.makedirs(save)
    assert load_path(cfg(save + "/", save))[0] is None  # empty (same directory spelled differently)
    os.makedirs(os.path.join(save, "iter_0000002.tmp"))  # a first save that died half-way
    assert load_path(cfg(save, save))[0] is None


def test_load_with_a_checkpoint_or_elsewhere_is_loaded(tmp_path):
    save = str(tmp_path / "ckpt")
    os.makedirs(save)
    with open(os.path.join(save, "latest"), "w") as f:
        f.write("2\n")
    assert load_path(cfg(save, save)) == (save, None)  # the loader resolves (or rejects) it
    other = str(tmp_path / "missing")
    assert load_path(cfg(other, save)) == (other, None)  # any other missing path stays an error, later
    assert load_path(cfg(None, save)) == (None, None)
