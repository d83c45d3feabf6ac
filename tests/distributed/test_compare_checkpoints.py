"""tools/compare_checkpoints.py: a tp=2 x pp=2 run and the one-process run, one step each: every first moment
(linear in the step-1 gradient) within the protocol's 5e-6, exit 0. The same checkpoint with one tensor's
bytes overwritten in its shard file (damage from outside, as a wrong layout would leave): that tensor comes
first, the damaged file is named, and the exit is nonzero."""

import os
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from megand.core.checkpointing import files, offline
from megand.tools.compare_checkpoints import compare
from tests.harness import ROOT, run_pretrain

ONE_STEP = ["+experiment=tiny_llama", "train.iters=1", "train.eval_iters=0"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    saves = {}
    for name, nproc, extra in (("one", 1, ()), ("tp2_pp2", 4, ("parallel.tp=2", "parallel.pp=2"))):
        saves[name] = str(root / name / "ckpt")
        run_pretrain(str(root / name), [*ONE_STEP, f"checkpoint.save={saves[name]}", *extra], nproc=nproc,
                     reference=nproc == 1)
    return saves


def tool(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "compare_checkpoints.py"), *args],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def corrupt(save: str, key: str) -> str:
    """Overwrite the values of the first piece of ``key`` in its shard file (they become 1 + 10x their value);
    return the file's name."""
    iter_dir = files.resolve(save)
    metadata = FileSystemReader(iter_dir).read_metadata()
    index, info = next((i, s) for i, s in metadata.storage_data.items() if i.fqn == key)
    chunk = metadata.state_dict_metadata[key].chunks[index.index]
    full = offline.load_tensors(save, [key], prefix="")[key]
    piece = full[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))].contiguous()
    path = os.path.join(iter_dir, info.relative_path)
    with open(path, "r+b") as f:
        f.seek(info.offset)
        item = f.read(info.length)
        raw = piece.numpy().tobytes()
        at = item.find(raw)  # the tensor's bytes inside its serialized item
        assert at >= 0
        f.seek(info.offset + at)
        f.write((1 + 10 * piece).numpy().tobytes())
    return info.relative_path


def test_layouts_agree_and_a_damaged_tensor_comes_first(checkpoints):
    one, tp2_pp2 = checkpoints["one"], checkpoints["tp2_pp2"]
    proc = tool(tp2_pp2, one, "--grads", "--rtol", "5e-6")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows, info = compare(tp2_pp2, one, grads=True)
    assert info["A"]["layout"]["tp"] == 2 and info["A"]["layout"]["pp"] == 2 and info["B"]["layout"]["world_size"] == 1
    assert rows and all(r.key.endswith(".exp_avg") for r in rows)
    assert max(r.rel for r in rows) <= 5e-6 and min(r.cosine for r in rows) > 1 - 1e-9
    everything, _ = compare(tp2_pp2, one)  # weights and every optimizer state too: same keys, same shapes
    assert {r.key for r in everything} >= {f"model.{r.key[6:-8]}" for r in rows} and not any(r.note for r in everything)

    victim = sorted(r.key for r in rows)[len(rows) // 2]
    damaged = corrupt(tp2_pp2, victim)
    proc = tool(tp2_pp2, one, "--grads", "--rtol", "5e-6")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    table = proc.stdout.splitlines()
    assert any(damaged in line and "checksum differs" in line for line in table)
    header = next(i for i, line in enumerate(table) if line.startswith("tensor"))
    assert table[header + 1].split()[0] == victim and "above --rtol" in table[header + 1]
    assert "above --rtol" not in table[header + 2]  # only the damaged tensor


def test_bad_input_is_one_line(tmp_path):
    proc = tool(str(tmp_path / "missing"), str(tmp_path))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "no such directory" in proc.stderr
