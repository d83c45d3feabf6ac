"""Runs on a save_to_disk directory (data.kind=hf_disk): a dp=2 run equals the one-process run (same
batches, losses within the parity tolerances); stopped and resumed, it trains on the same samples with
bit-identical losses; a bad directory stops the run before training with one line, exit code 2."""

from tests.harness import assert_parity, read_metrics, run_pretrain
from tests.unit.test_hf_disk import write_hf_dataset

ITERS = 6


def common(directory, *extra):
    return ["+experiment=tiny_gpt", "data=hf_disk", f"data.paths=[[1.0,{directory}]]", "model.vocab_size=1000",
            "data.workers=0", "train.eval_iters=0", "train.batch_checksum=true", f"train.iters={ITERS}", *extra]


def test_hf_disk_runs_at_dp2_as_on_one_process_and_resume_exactly(tmp_path):
    write_hf_dataset(tmp_path / "d", 400, num_shards=3)
    single = str(tmp_path / "single")
    run_pretrain(single, common(tmp_path / "d"), reference=True)
    ref = read_metrics(single)
    straight = str(tmp_path / "straight")
    run_pretrain(straight, common(tmp_path / "d", "parallel.dp=2"), nproc=2)
    dp2 = read_metrics(straight)
    assert [r["batch_checksum"] for r in dp2] == [r["batch_checksum"] for r in ref]
    assert_parity(ref, dp2, steps=ITERS)
    # stopped after 3 steps, resumed to 6: the same samples and bit-identical losses as straight through
    save, split = str(tmp_path / "ckpt"), str(tmp_path / "split")
    args = common(tmp_path / "d", "parallel.dp=2", f"checkpoint.save={save}", f"checkpoint.load={save}")
    run_pretrain(split, [*args, "train.exit_interval=3"], nproc=2)
    run_pretrain(split, args, nproc=2)
    resumed = read_metrics(split)
    assert [r["iter"] for r in resumed] == list(range(1, ITERS + 1))
    assert [(r["loss"], r["batch_checksum"]) for r in resumed] == [(r["loss"], r["batch_checksum"]) for r in dp2]


def test_a_bad_directory_stops_the_run_in_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = run_pretrain(str(tmp_path / "run"), common(tmp_path / "empty"), check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and f"{tmp_path / 'empty'}: no state.json" in lines[0], lines
