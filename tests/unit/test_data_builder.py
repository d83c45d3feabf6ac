import numpy as np
import pytest

import megand.data.quickstart as quickstart
from megand.data.blended_dataset import BlendedDataset
from megand.data.builder import build_datasets, parse_split, split_ranges
from megand.data.errors import DataError
from megand.data.gpt_dataset import GPTDataset
from megand.data.mock import MockGPTDataset
from megand.data.quickstart import prepare_quickstart_corpus

from tests.unit.data_helpers import train_small_tokenizer, unique_token_docs, write_indexed

SEQ, VOCAB = 16, 1 << 16  # the token ids are positions in the corpus: the vocabulary must hold them


@pytest.fixture
def prefixes(tmp_path):
    rng = np.random.default_rng(0)
    return [write_indexed(tmp_path / f"d{k}", unique_token_docs(rng.integers(5, 60, size=200))) for k in range(2)]


def cfg(prefixes, tmp_path, **over):
    base = {"kind": "indexed", "paths": [[0.3, prefixes[0]], [0.7, prefixes[1]]], "tokenizer": None,
            "split": "90,5,5", "cache_dir": str(tmp_path / "cache")}
    return {**base, **over}


def test_mock_splits_are_disjoint():
    train, valid, test = build_datasets({"kind": "mock"}, SEQ, VOCAB, 1, (10, 5, 0))
    assert isinstance(train, MockGPTDataset) and len(train) == 10 and len(valid) == 5 and test is None
    assert (train.offset, valid.offset) == (0, 10**9)
    assert not np.array_equal(train[0], valid[0])


def test_indexed_blend_builds_and_is_cached(prefixes, tmp_path):
    train, valid, test = build_datasets(cfg(prefixes, tmp_path), SEQ, VOCAB, 1, (300, 20, 10))
    assert isinstance(train, BlendedDataset) and (len(train), len(valid), len(test)) == (300, 20, 10)
    assert train[0].shape == (SEQ + 1,) and train[0].dtype == np.int64
    again, _, _ = build_datasets(cfg(prefixes, tmp_path), SEQ, VOCAB, 1, (300, 20, 10))
    assert not again.indices_built and not any(d.indices_built for d in again.datasets)
    single, _, _ = build_datasets(cfg(prefixes, tmp_path, paths=[[1, prefixes[0]]]), SEQ, VOCAB, 1, (50, 0, 0))
    assert isinstance(single, GPTDataset)


def test_split_by_documents():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.030, 0.001])
    assert split_ranges(1000, parse_split("969,30,1")) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges(10, parse_split("100,0,0")) == [(0, 10), (10, 10), (10, 10)]


@pytest.mark.parametrize("missing", [".bin", ".idx"])
def test_missing_file(prefixes, tmp_path, missing):
    (tmp_path / f"d1{missing}").unlink()
    with pytest.raises(DataError, match=rf"d1\{missing}: missing"):
        build_datasets(cfg(prefixes, tmp_path), SEQ, VOCAB, 1, (10, 0, 0))


def test_idx_not_matching_bin(prefixes, tmp_path):
    with open(tmp_path / "d0.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(DataError, match=r"d0\.idx does not match"):
        build_datasets(cfg(prefixes, tmp_path), SEQ, VOCAB, 1, (10, 0, 0))


def test_tokenizer_larger_than_model_vocab(prefixes, tmp_path):
    model = train_small_tokenizer(tmp_path, vocab_size=400)
    with pytest.raises(DataError, match=r"tok\.model: tokenizer vocab size 400 is larger than model.vocab_size=256"):
        build_datasets(cfg(prefixes, tmp_path, tokenizer=model), SEQ, 256, 1, (10, 0, 0))


def test_empty_split(prefixes, tmp_path):
    with pytest.raises(DataError, match=r"d0: the valid split .*'100,0,0'.* has 0 documents"):
        build_datasets(cfg(prefixes, tmp_path, split="100,0,0"), SEQ, VOCAB, 1, (10, 5, 0))
    assert not (tmp_path / "cache").exists()  # failed before building anything


@pytest.mark.parametrize("paths,match", [([[0, "a"], [0.0, "b"]], "sum to 0.0"),
                                         ([[-1, "a"], [2, "b"]], "non-negative"),
                                         ([["a", 1]], "expected \\[weight, prefix\\]"),
                                         ([], "data.paths is empty")])
def test_bad_weights(paths, match, tmp_path):
    with pytest.raises(DataError, match=match):
        build_datasets({"kind": "indexed", "paths": paths, "split": "1,0,0"}, SEQ, VOCAB, 1, (10, 0, 0))


def test_quickstart_corpus_builds_once(tmp_path, monkeypatch):
    prefix, model = prepare_quickstart_corpus(str(tmp_path), vocab_size=1000)
    train, _, _ = build_datasets({"kind": "indexed", "paths": [[1.0, prefix]], "tokenizer": model,
                                  "split": "90,5,5", "cache_dir": str(tmp_path / "idx")}, 64, 1024, 1, (20, 5, 5))
    assert len(train) == 20 and train[0].max() < 1000

    def no_build(*a, **k):
        raise AssertionError("quickstart corpus rebuilt")

    monkeypatch.setattr(quickstart, "train_sentencepiece", no_build)
    assert prepare_quickstart_corpus(str(tmp_path), vocab_size=1000) == (prefix, model)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".quickstart")] == []
