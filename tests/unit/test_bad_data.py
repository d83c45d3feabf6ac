"""Damaged or mismatched training data fails when it loads, in one line naming the file and values,
whatever the layout, and leaves the user's files as they were."""

import hashlib

import numpy as np
import pytest

import megand.data.token_range as token_range
from megand.data.errors import DataError
from megand.data.indexed_dataset import _HEADER_BYTES, IndexedDataset
from megand.data.token_range import check_token_ids
from tests.harness import run_pretrain
from tests.unit.data_helpers import write_indexed

DOCS, LENGTH = 1000, 61


def corpus(tmp_path, high=251, name="corpus"):
    """DOCS documents of LENGTH tokens with ids in [0, high)."""
    rng = np.random.default_rng(0)
    return write_indexed(tmp_path / name, [rng.integers(0, high, LENGTH) for _ in range(DOCS)], dtype=np.uint16)


def digests(*paths):
    return {str(p): hashlib.sha256(open(p, "rb").read()).hexdigest() for p in paths}


def flip_bit(path, offset, bit):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def indexed_run(tmp_path, prefix, extra=(), nproc=1):
    run_dir = tmp_path / "run"
    proc = run_pretrain(run_dir, ["+experiment=tiny_gpt", "data=indexed", f"data.paths=[[1.0,{prefix}]]",
                                  "train.iters=2", *extra], nproc=nproc, check=False)
    return proc, run_dir


def assert_one_line_exit_2(proc, run_dir, *named):
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    for value in named:
        assert value in lines[0], lines[0]
    assert not (run_dir / "metrics.jsonl").exists()  # no step was taken


def test_flipped_size_bit_in_idx_is_found(tmp_path):
    prefix = corpus(tmp_path)
    flip_bit(prefix + ".idx", _HEADER_BYTES + 4 * 500 + 1, 0)  # sizes[500]: 61 -> 317
    with pytest.raises(DataError, match=r"corpus\.idx: corrupted index: sequence_pointers\[501\]=61122 but the "
                                        r"sizes of sequences 0\.\.500 add up to byte 61634"):
        IndexedDataset(prefix)


def test_document_index_out_of_order_is_found(tmp_path):
    prefix = corpus(tmp_path)
    flip_bit(prefix + ".idx", _HEADER_BYTES + 12 * DOCS + 8 * 300 + 1, 6)  # document_indices[300]: 300 -> 16684
    with pytest.raises(DataError, match=r"document_indices\[301\]=301 is smaller than document_indices\[300\]=16684"):
        IndexedDataset(prefix)


def test_document_index_not_ending_at_the_sequence_count_is_found(tmp_path):
    prefix = corpus(tmp_path)
    flip_bit(prefix + ".idx", _HEADER_BYTES + 12 * DOCS + 8 * DOCS, 0)  # the last entry: 1000 -> 1001
    with pytest.raises(DataError, match=r"document_indices run 0\.\.1001, expected 0\.\.1000"):
        IndexedDataset(prefix)


def test_flipped_idx_stops_training_in_one_line(tmp_path):
    prefix = corpus(tmp_path)
    flip_bit(prefix + ".idx", _HEADER_BYTES + 4 * 500 + 1, 0)
    before = digests(prefix + ".idx", prefix + ".bin")
    proc, run_dir = indexed_run(tmp_path, prefix)
    assert_one_line_exit_2(proc, run_dir, "corpus.idx", "sequence_pointers[501]=61122")
    assert digests(prefix + ".idx", prefix + ".bin") == before


def test_token_ids_beyond_the_vocab_are_found_once_and_cached(tmp_path, monkeypatch):
    prefix = corpus(tmp_path, high=1000)
    ds = IndexedDataset(prefix)
    check_token_ids(ds, 1000, str(tmp_path / "cache"))
    with pytest.raises(DataError, match=r"corpus\.bin: holds token ids up to 999, not below model.vocab_size=251"):
        check_token_ids(ds, 251, str(tmp_path / "cache"))

    def no_second_scan(_):
        raise AssertionError("the token range was scanned again")

    monkeypatch.setattr(token_range, "scan_token_range", no_second_scan)
    with pytest.raises(DataError, match="up to 999"):
        check_token_ids(ds, 251, str(tmp_path / "cache"))


def test_token_ids_beyond_the_vocab_stop_tp2_training_in_one_line(tmp_path):
    # at tp=2 each rank masks the ids outside its vocabulary shard: without the check this trains silently
    prefix = corpus(tmp_path, high=1000)
    before = digests(prefix + ".idx", prefix + ".bin")
    proc, run_dir = indexed_run(tmp_path, prefix, ["parallel.tp=2"], nproc=2)
    assert_one_line_exit_2(proc, run_dir, "corpus.bin", "token ids up to 999", "model.vocab_size=251")
    assert digests(prefix + ".idx", prefix + ".bin") == before


@pytest.mark.parametrize("case", ["truncated_bin", "prefix_with_extension"])
def test_unusable_files_stop_training_in_one_line(tmp_path, case):
    prefix = corpus(tmp_path)
    if case == "truncated_bin":
        with open(prefix + ".bin", "r+b") as f:
            f.truncate(1000)
        given, named = prefix, ["corpus.idx does not match", "corpus.bin", "the .bin holds 1000"]
    else:
        given, named = prefix + ".bin", [f"give the prefix without the extension: {prefix}"]
    before = digests(prefix + ".idx", prefix + ".bin")
    proc, run_dir = indexed_run(tmp_path, given)
    assert_one_line_exit_2(proc, run_dir, *named)
    assert digests(prefix + ".idx", prefix + ".bin") == before
