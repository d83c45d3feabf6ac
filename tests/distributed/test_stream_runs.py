"""Stream runs (data.kind=stream): a run killed from outside (SIGKILL) and resumed from its last checkpoint
trains on the same tokens with bit-identical losses as the uninterrupted run at the same layout; resumed
at dp=4 from a dp=2 checkpoint it trains on the same global batches (batch_checksum) with losses within
the parity tolerances; a tp=2 run (one reader per data-parallel rank, broadcast to its tensor-parallel
peer) reads the same batches too."""

import json
import os
import pathlib

import pytest

from tests.distributed.test_checkpoint_faults import kill_job, launch, metric_lines, wait_for
from tests.harness import assert_parity, read_metrics, run_pretrain
from tests.unit.test_stream import write_corpus

ITERS = 12


def by_iteration(run_dir) -> dict[int, dict]:
    """The last training record of each iteration (a killed run's resume logs some again)."""
    return {r["iter"]: r for r in read_metrics(run_dir)}


def common(corpus, *extra):
    return ["+experiment=tiny_gpt", "data=stream", f"data.paths=[[1.0,{corpus}]]", "model.vocab_size=1000",
            "train.eval_iters=0", "train.batch_checksum=true", f"train.iters={ITERS}", *extra]


@pytest.mark.slow
def test_killed_stream_run_resumes_exactly_and_reshards_to_dp4(tmp_path):
    corpus = tmp_path / "corpus"
    write_corpus(pathlib.Path(corpus), 400)
    reference = str(tmp_path / "reference")
    run_pretrain(reference, common(corpus, "data.workers=1"), nproc=2)  # tokenizer worker processes
    ref = by_iteration(reference)
    assert sorted(ref) == list(range(1, ITERS + 1))

    run_dir, save = str(tmp_path / "killed"), str(tmp_path / "ckpt")
    args = common(corpus, "data.workers=0", f"checkpoint.save={save}", "checkpoint.interval=3")
    proc = launch(run_dir, args, 2)
    wait_for(lambda: metric_lines(run_dir) >= 8, proc)
    kill_job(proc)  # SIGKILL from outside: no save at the stop
    proc.wait()
    with open(os.path.join(save, "latest")) as f:
        last = int(f.read())
    assert 3 <= last < ITERS
    run_pretrain(run_dir, [*args, f"checkpoint.load={save}"], nproc=2)
    resumed = by_iteration(run_dir)
    assert sorted(resumed) == list(range(1, ITERS + 1))
    for it in range(1, ITERS + 1):  # bit-identical
        assert (resumed[it]["loss"], resumed[it]["batch_checksum"]) == (ref[it]["loss"], ref[it]["batch_checksum"]), it

    # the dp=2 checkpoint of iteration 6 resumed at dp=4: the same global batches from there on
    wide = str(tmp_path / "dp4")
    run_pretrain(wide, common(corpus, "data.workers=0", f"checkpoint.load={save}/iter_0000006"), nproc=4)
    after = by_iteration(wide)
    assert sorted(after) == list(range(7, ITERS + 1))
    assert [after[i]["batch_checksum"] for i in after] == [ref[i]["batch_checksum"] for i in after]
    assert_parity([ref[i] for i in after], [after[i] for i in after], steps=len(after))


@pytest.mark.slow
def test_tensor_parallel_peers_share_one_reader(tmp_path):
    corpus = tmp_path / "corpus"
    write_corpus(pathlib.Path(corpus), 400)
    single, tp2 = str(tmp_path / "single"), str(tmp_path / "tp2")
    run_pretrain(single, common(corpus, "data.workers=0"), nproc=1)
    run_pretrain(tp2, common(corpus, "data.workers=0", "parallel.tp=2"), nproc=2)
    a, b = read_metrics(single), read_metrics(tp2)
    assert [r["batch_checksum"] for r in a] == [r["batch_checksum"] for r in b]
    assert_parity(a, b)
    with open(os.path.join(tp2, "config.yaml")) as f:
        assert "kind: stream" in f.read()


@pytest.mark.slow
def test_malformed_rows_stop_every_rank_with_one_line_or_are_skipped(tmp_path):
    corpus = tmp_path / "corpus"
    write_corpus(pathlib.Path(corpus), 200)
    with open(corpus / "a.jsonl", "a") as f:
        f.writelines('{"text": "1 2 3"\n' for _ in range(60))  # the file's rows 51..110: met in the first steps
    args = [*common(corpus, "data.workers=0"), "train.iters=3"]
    proc = run_pretrain(str(tmp_path / "fail"), args, nproc=2, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "a.jsonl:" in lines[0] and ": invalid JSON" in lines[0], lines
    proc = run_pretrain(str(tmp_path / "skip"), [*args, "data.on_error=skip"], nproc=2)
    assert proc.stdout.count("data.on_error=skip: skipping malformed rows, the first: ") >= 1
    assert len(read_metrics(str(tmp_path / "skip"))) == 3


SPIKE, INTERVAL = 17, 5


def spiky_stream(directory, lanes=8, seq=32) -> None:
    """Learnable documents (counting mod 10, as token ids); those lying wholly inside the samples of
    iteration SPIKE are replaced by random ids of the same length (so the packing, and every other batch,
    is unchanged)."""
    import numpy as np

    from megand.data.stream import StreamSource

    rng = np.random.default_rng(0)
    directory.mkdir()
    docs = [" ".join(str((i + rng.integers(0, 10)) % 10) for i in range(rng.integers(3, 9))) for _ in range(2000)]
    path = directory / "a.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    source = StreamSource({"paths": [[1.0, str(directory)]], "workers": 0}, seq, 1000, seed=1234).open(lanes, 0, lanes)
    source.history = {}
    for _ in range(SPIKE - 1):
        source.next_samples()
    starts = {lane.index: (lane.docs[0], lane.offset) for lane in source.mine}
    source.next_samples()
    rows = set()
    for lane in source.mine:
        taken = source.history[lane.index]
        first, offset = starts[lane.index]
        position = -offset  # of the document's first token in the sample
        for doc in taken[next(i for i, d in enumerate(taken) if d is first):]:
            if position >= 0 and position + len(doc.tokens) <= seq:  # wholly inside (the last token is shared)
                rows.add(int(doc.where.rsplit(":", 1)[1]))
            position += len(doc.tokens)
            if position >= seq:
                break
    for row in rows:
        docs[row - 1] = " ".join(str(x) for x in rng.integers(10, 990, len(docs[row - 1].split())))
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))


@pytest.mark.slow  # rollback runs in the default suite in test_spike_rollback_resume
def test_spike_rollback_of_a_stream_skips_exactly_the_spike_batch(tmp_path):
    corpus = tmp_path / "corpus"
    spiky_stream(corpus)
    args = ["+experiment=tiny_gpt", "data=stream", f"data.paths=[[1.0,{corpus}]]", "model.vocab_size=1000",
            "train.eval_iters=0", "train.batch_checksum=true", "train.iters=20", "data.workers=0", "optim.lr=3e-3",
            "train.spike_window=5", "train.spike_factor=1.5"]
    through = str(tmp_path / "through")  # no rollback: trains on the spike's batch
    run_pretrain(through, args, nproc=2)
    plain = by_iteration(through)
    assert [i for i, r in plain.items() if r["spike"]] == [SPIKE]
    rolled = str(tmp_path / "rolled")
    proc = run_pretrain(rolled, [*args, "train.spike_rollback=true", "train.max_rollbacks=1",
                                 f"checkpoint.save={tmp_path}/ckpt", f"checkpoint.interval={INTERVAL}"], nproc=2)
    assert f"loss spike at iteration {SPIKE}: rolled back to iteration 15" in proc.stdout
    records = read_metrics(rolled)
    after = records[SPIKE:]  # iterations 16.. again, on the batches after the spike's
    assert [r["iter"] for r in after] == list(range(16, 21))
    # the rolled-back run reads stream batches 18.. where the uninterrupted one read 18..20
    assert [r["batch_checksum"] for r in after[:3]] == [plain[i]["batch_checksum"] for i in (18, 19, 20)]


RAMP_BATCHES = [2, 2, 4, 6, 8, 8]  # train.rampup_batch_size=[2,2,12]: one increment of 2 every 4 samples


@pytest.mark.slow
def test_stream_ramp_up_and_validation_stream_resume_at_another_dp(tmp_path):
    """Under a batch ramp-up, slot s of every batch is lane s: a dp=2 run (lanes change readers as the batch
    grows) stopped mid-ramp and resumed at dp=1 trains on the batches of the uninterrupted dp=1 run, and
    evaluates on the held-out stream of data.valid_paths (the same batches at every layout)."""
    write_corpus(tmp_path / "train", 400)
    (tmp_path / "held").mkdir()
    (tmp_path / "held" / "valid.jsonl").write_text("".join(
        json.dumps({"text": " ".join(str(7 + (i * k) % 900) for k in range(20))}) + "\n" for i in range(100)))
    args = ["+experiment=tiny_gpt", "data=stream", f"data.paths=[[1.0,{tmp_path / 'train'}]]",
            f"data.valid_paths=[[1.0,{tmp_path / 'held'}]]", "model.vocab_size=1000", "data.workers=0",
            "train.eval_iters=2", "train.eval_interval=3", "train.micro_batch_size=1", "train.batch_checksum=true",
            "train.rampup_batch_size=[2,2,12]", "train.iters=6", "optim.warmup_iters=2"]
    whole = str(tmp_path / "whole")
    run_pretrain(whole, args)
    ref = read_metrics(whole)
    assert [r["global_batch_size"] for r in ref] == RAMP_BATCHES
    save, split = str(tmp_path / "ckpt"), str(tmp_path / "split")
    run_pretrain(split, [*args, "parallel.dp=2", f"checkpoint.save={save}", "train.exit_interval=3"], nproc=2)
    run_pretrain(split, [*args, f"checkpoint.save={save}", f"checkpoint.load={save}"])
    resumed = read_metrics(split)
    assert [r["iter"] for r in resumed] == list(range(1, 7))
    assert [r["batch_checksum"] for r in resumed] == [r["batch_checksum"] for r in ref]
    assert_parity(ref, resumed, steps=6)

    def evaluations(run_dir):
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return {r["iter"]: r["val_loss"] for r in map(json.loads, f) if "val_loss" in r}

    expected, got = evaluations(whole), evaluations(split)
    assert sorted(expected) == [3, 6] and sorted(got) == [3, 6]
    for it in (3, 6):
        assert abs(got[it] - expected[it]) <= 1e-4 * abs(expected[it]), (it, got[it], expected[it])


def test_a_validation_stream_that_overlaps_training_is_refused(tmp_path):
    write_corpus(tmp_path / "train", 100)
    args = [a for a in common(tmp_path / "train") if not a.startswith("train.eval_iters=")]
    proc = run_pretrain(str(tmp_path / "run"), [*args, "train.eval_iters=1",
                                                 f"data.valid_paths=[[1.0,{tmp_path / 'train'}/a.jsonl]]"], check=False)
    assert proc.returncode == 2
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "data.valid_paths holds 1 file(s) that data.paths trains on" in lines[0], lines


def test_a_resume_on_a_changed_corpus_stops_before_training(tmp_path):
    """Appending documents to a file of the stream since the checkpoint: the resume stops every rank with one
    line naming the file and the change, exit code 2, before any step (it used to repeat documents)."""
    corpus = tmp_path / "corpus"
    write_corpus(pathlib.Path(corpus), 200)
    save, run_dir = str(tmp_path / "ckpt"), str(tmp_path / "run")
    args = [*common(corpus, "data.workers=0", f"checkpoint.save={save}", f"checkpoint.load={save}"), "train.iters=2"]
    run_pretrain(run_dir, args, nproc=2)
    with open(corpus / "a.jsonl", "a") as f:
        f.writelines(json.dumps({"text": f"7 {i} 7"}) + "\n" for i in range(20))
    proc = run_pretrain(run_dir, [*args, "train.iters=4"], nproc=2, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and f"{corpus / 'a.jsonl'}: changed since the checkpoint: " in lines[0], lines
    assert [r["iter"] for r in read_metrics(run_dir)] == [1, 2]
