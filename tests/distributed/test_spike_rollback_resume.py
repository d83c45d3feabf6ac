"""Spike rollback in a resumed run goes back to the checkpoint the run came from or saved last, never to
another run's newer one, restores the spike guard's window as it was there, and counts rollbacks across
resumes. The spike is a batch of random tokens inside learnable text (the data, from outside the ranks)."""

import os

import numpy as np
import pytest
import torch

from megand.data.gpt_dataset import GPTDataset
from megand.data.indexed_dataset import IndexedDataset
from tests.harness import read_metrics, run_pretrain
from tests.unit.data_helpers import write_indexed

SEQ, GBS, SPIKE, WINDOW = 32, 8, 17, 5


def spiky_corpus(tmp_path) -> str:
    """400 learnable documents; the ones that iteration SPIKE reads (single epoch, served in the shuffle
    order of seed 1234) replaced by random tokens."""
    rng = np.random.default_rng(0)
    docs = [(np.arange(SEQ) + rng.integers(0, 10)) % 10 for _ in range(400)]
    prefix = str(tmp_path / "corpus")
    write_indexed(prefix, docs)
    order = GPTDataset(IndexedDataset(prefix), (0, len(docs)), SEQ, 1234, 300)  # one epoch: any size <= 387 alike
    for position in range((SPIKE - 1) * GBS, SPIKE * GBS):
        first_doc, _ = order.sample_index[order.shuffle_index[position]]
        docs[order.document_index[first_doc]] = rng.integers(10, 250, SEQ)
    return write_indexed(prefix, docs)


def common(tmp_path, prefix):
    return ["+experiment=tiny_gpt", "data=indexed", f"data.paths=[[1.0,{prefix}]]", "data.split='1000,0,0'",
            f"data.cache_dir={tmp_path}/cache", "train.eval_iters=0", "optim.lr=3e-3",
            f"train.spike_window={WINDOW}", "train.spike_factor=1.8"]


@pytest.mark.slow
def test_rollback_of_a_resumed_run_goes_back_to_where_it_came_from(tmp_path):
    prefix = spiky_corpus(tmp_path)
    first = str(tmp_path / "first")  # iter_5..iter_20 (trained through the spike: no rollback)
    run_pretrain(str(tmp_path / "run1"), [*common(tmp_path, prefix), "train.iters=20", f"checkpoint.save={first}",
                                          "checkpoint.interval=5"])
    saved = torch.load(os.path.join(first, "iter_0000010", "common.pt"), weights_only=True)["extra"]
    assert len(saved["spike_window"]) == WINDOW and saved["rollbacks"] == 0

    # (1) loaded from another directory, the spike comes before this run's first save
    other = str(tmp_path / "other")
    rollback_args = ["train.iters=18", "train.spike_rollback=true", "train.max_rollbacks=1",
                     "checkpoint.interval=10", f"checkpoint.load={first}/iter_0000010"]
    run_dir = str(tmp_path / "run2")
    proc = run_pretrain(run_dir, [*common(tmp_path, prefix), *rollback_args, f"checkpoint.save={other}"],
                        check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"rolled back to iteration 10 ({first}/iter_0000010) and skipped samples [80, 136) (56 samples" in proc.stdout
    records = read_metrics(run_dir)
    assert [r["iter"] for r in records if r.get("spike")] == [SPIKE]
    assert [r["iter"] for r in records][-8:] == list(range(11, 19))  # 11..18 again, after the spike's data
    assert torch.load(os.path.join(other, "iter_0000018", "common.pt"), weights_only=True)["extra"]["rollbacks"] == 1

    # (2) resumed from an older checkpoint of the save directory: never forward into the newer iter_20
    run_dir = str(tmp_path / "run3")
    proc = run_pretrain(run_dir, [*common(tmp_path, prefix), *rollback_args, f"checkpoint.save={first}"],
                        check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"rolled back to iteration 10 ({first}/iter_0000010) and skipped samples [80, 136)" in proc.stdout
    assert "-" not in proc.stdout.split("skipped samples")[1].split(")")[1]  # no negative count


def test_the_rollback_count_survives_a_resume(tmp_path):
    """A run resumed from a checkpoint saved after its train.max_rollbacks=1 rollback only logs the next
    spike; and the window restored from the checkpoint detects it at once (no refill after a resume)."""
    prefix = spiky_corpus(tmp_path)
    save = str(tmp_path / "ckpt")
    base = [*common(tmp_path, prefix), "train.spike_rollback=true", "train.max_rollbacks=1", f"checkpoint.save={save}",
            "checkpoint.interval=5"]
    run_pretrain(str(tmp_path / "a"), [*base, "train.iters=18", "train.exit_interval=12"])  # stops (saved) at 12
    # edit the saved count as a run that already rolled back would have written it
    path = os.path.join(save, "iter_0000012", "common.pt")
    state = torch.load(path, weights_only=True)
    assert state["extra"]["rollbacks"] == 0 and len(state["extra"]["spike_window"]) == WINDOW
    state["extra"]["rollbacks"] = 1
    torch.save(state, path)
    os.remove(os.path.join(save, "iter_0000012", "manifest.json"))  # its checksum no longer holds
    run_dir = str(tmp_path / "b")
    proc = run_pretrain(run_dir, [*base, "train.iters=18", f"checkpoint.load={save}"])
    records = read_metrics(run_dir)
    assert [r["iter"] for r in records if r.get("spike")] == [SPIKE]
    assert "rolled back" not in proc.stdout
    assert [r["iter"] for r in records] == list(range(13, 19))
