"""The guards of long runs, driven by the data and the config from outside the ranks:
- non-finite steps are skipped on every rank together, counted, and stop the run (exit 3) after
  train.max_skipped_steps in a row, without ever saving the non-finite state;
- a loss spike (a batch of random tokens inside learnable text) is detected at its iteration, rolled
  back to the last checkpoint, and exactly the samples from that checkpoint to the spike are skipped."""

import os

import numpy as np

from megand.data.gpt_dataset import GPTDataset
from megand.data.indexed_dataset import IndexedDataset
from tests.harness import read_metrics, run_pretrain
from tests.unit.data_helpers import write_indexed


def test_non_finite_steps_skip_together_then_stop_without_saving(tmp_path):
    save = str(tmp_path / "ckpt")
    common = ["+experiment=tiny_gpt", "train.precision=fp16", "train.eval_iters=0", f"checkpoint.save={save}"]
    run_pretrain(str(tmp_path / "good"), [*common, "train.iters=2"], nproc=2)
    # an absurd learning rate: the step-3 update overflows the fp16 weights, every later loss is NaN
    run_dir = str(tmp_path / "bad")
    proc = run_pretrain(run_dir, [*common, "train.iters=20", "optim.lr=1e10", "train.max_skipped_steps=3",
                                  f"checkpoint.load={save}", "checkpoint.interval=1"], nproc=2, check=False)
    assert proc.returncode == 3, proc.stderr[-3000:]
    stop = [x for x in proc.stderr.splitlines() if x.startswith("megand: training stopped")]
    assert len(stop) == 2  # both ranks stop together, with the same message
    assert "3 consecutive steps skipped (train.max_skipped_steps=3): the first bad iteration was 4, non-finite loss" in stop[0]
    assert "first non-finite gradient: parameter " in stop[0] and " on rank " in stop[0]
    records = read_metrics(run_dir)
    assert [(r["iter"], r["skipped"]) for r in records] == [(3, 0), (4, 1), (5, 1), (6, 1)]
    assert records[-1]["skipped_total"] == 3
    assert proc.stdout.count("not saving a checkpoint") == 3  # iterations 3 (inf weights), 4, 5
    with open(os.path.join(save, "latest")) as f:
        assert f.read().strip() == "2"
    assert sorted(os.listdir(save)) == ["iter_0000002", "latest"]


SEQ, GBS, ITERS, INTERVAL, SPIKE = 32, 8, 30, 5, 23


def test_spike_rolls_back_and_skips_the_samples_up_to_it(tmp_path):
    rng = np.random.default_rng(0)
    docs = [(np.arange(SEQ) + rng.integers(0, 10)) % 10 for _ in range(400)]  # learnable: counting mod 10
    prefix = str(tmp_path / "corpus")
    write_indexed(prefix, docs)
    # the documents of the samples that iteration SPIKE reads (the train split is one epoch of them)
    num_samples = ITERS * GBS + 1 * INTERVAL * GBS  # plus what one rollback may skip
    order = GPTDataset(IndexedDataset(prefix), (0, len(docs)), SEQ, 1234, num_samples)
    for position in range((SPIKE - 1) * GBS, SPIKE * GBS):
        first_doc, _ = order.sample_index[order.shuffle_index[position]]
        docs[order.document_index[first_doc]] = rng.integers(10, 250, SEQ)  # random tokens
    write_indexed(prefix, docs)

    run_dir, save = str(tmp_path / "run"), str(tmp_path / "ckpt")
    proc = run_pretrain(run_dir, ["+experiment=tiny_gpt", "data=indexed", f"data.paths=[[1.0,{prefix}]]",
                                  "data.split='1000,0,0'", f"data.cache_dir={tmp_path}/cache", "train.eval_iters=0",
                                  "train.batch_checksum=true",
                                  f"train.iters={ITERS}", "optim.lr=3e-3", "train.spike_window=5",
                                  "train.spike_rollback=true", "train.max_rollbacks=1", f"checkpoint.save={save}",
                                  f"checkpoint.interval={INTERVAL}"], nproc=2)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        import json

        lines = [json.loads(x) for x in f]
    spikes = [r for r in lines if r.get("spike")]
    assert [r["iter"] for r in spikes] == [SPIKE]
    rollback = next(r for r in lines if "rollback_to" in r)
    assert rollback["iter"] == SPIKE and rollback["rollback_to"] == 20
    assert rollback["skipped_samples"] == [20 * GBS, SPIKE * GBS]
    assert "loss spike at iteration 23: rolled back to iteration 20" in proc.stdout
    after = read_metrics(run_dir)[SPIKE:]  # the steps after the rollback: 21..30 again
    assert [r["iter"] for r in after] == list(range(21, ITERS + 1))
    assert [r["consumed_samples"] for r in after] == [(it + SPIKE - 20) * GBS for it in range(21, ITERS + 1)]
    # iteration 21 now reads the samples right after the spike's batch
    data = GPTDataset(IndexedDataset(prefix), (0, len(docs)), SEQ, 1234, num_samples)
    expected = sum(int(((data[p][:-1] + 1) * (np.arange(SEQ) + 1)).sum()) for p in range(SPIKE * GBS, (SPIKE + 1) * GBS))
    assert after[0]["batch_checksum"] == expected
    assert max(r["loss"] for r in after) < spikes[0]["loss"] / 3  # training goes on below the spike
