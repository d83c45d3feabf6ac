"""Every file of a checkpoint is checksummed: a damaged one stops the resumed run before training, in one
line naming the file, and the checkpoint is left as it was."""

import hashlib
import os
import shutil

import pytest

from tests.harness import run_pretrain

RUN = ["+experiment=tiny_gpt", "train.eval_iters=0"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of iteration 2 (consumed samples 16)."""
    root = tmp_path_factory.mktemp("saved")
    run_pretrain(root / "run", [*RUN, "train.iters=2", f"checkpoint.save={root / 'ckpt'}"])
    return root / "ckpt"


def flip_consumed_samples(path):
    """16 -> 17 in the pickled ``consumed_samples`` of common.pt: the file still loads."""
    data = bytearray(path.read_bytes())
    at = data.index(b"consumed_samples")
    value = data.index(b"K\x10", at)  # BININT1 16, right after the key
    assert value - at < 24
    data[value + 1] = 0x11
    path.write_bytes(bytes(data))


def flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def digests(directory):
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name, damage", [("common.pt", flip_consumed_samples),
                                          pytest.param("rng/rank_00000.pt", flip_last_byte, marks=pytest.mark.slow),
                                          pytest.param("config.yaml", flip_last_byte, marks=pytest.mark.slow),
                                          (".metadata", flip_last_byte)])
def test_damaged_checkpoint_file_stops_resume_in_one_line(saved, tmp_path, name, damage):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    damage(ckpt / "iter_0000002" / name)
    before = digests(ckpt)
    proc = run_pretrain(tmp_path / "run", [*RUN, "train.iters=4", f"checkpoint.save={ckpt}", f"checkpoint.load={ckpt}"], check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    assert os.path.join(str(ckpt), "iter_0000002", name) in lines[0] and "corrupted" in lines[0], lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert digests(ckpt) == before  # latest still names iteration 2; nothing rewritten
