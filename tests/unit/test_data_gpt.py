import numpy as np
import pytest

import megand.data.gpt_dataset as gpt_dataset
from megand.data.gpt_dataset import GPTDataset
from megand.data.indexed_dataset import IndexedDataset

from tests.unit.data_helpers import unique_token_docs, write_indexed

SEQ = 16


@pytest.fixture
def corpus(tmp_path):
    """60 documents (one empty) whose tokens are their stream positions; 16k+1 tokens in total."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, size=60)
    lengths[10] = 0
    lengths[-1] += (1 - lengths.sum()) % SEQ  # total - 1 divisible by SEQ: one epoch uses every token
    return IndexedDataset(write_indexed(tmp_path / "u", unique_token_docs(lengths)))


def stream(ds: GPTDataset) -> np.ndarray:
    return np.concatenate([ds.indexed[int(d)] for d in ds.document_index])


def test_samples_are_windows_of_the_document_stream(corpus, tmp_path):
    ds = GPTDataset(corpus, (0, 60), SEQ, seed=3, num_samples=250, cache_dir=str(tmp_path / "c"))  # ~3.5 epochs
    s = stream(ds)
    assert len(ds) == 250
    for i in range(len(ds)):
        j = int(ds.shuffle_index[i])
        sample = ds[i]
        assert sample.dtype == np.int64 and sample.shape == (SEQ + 1,)
        np.testing.assert_array_equal(sample, s[j * SEQ: j * SEQ + SEQ + 1])


def test_one_epoch_covers_every_token_of_the_split(corpus):
    first, last = 5, 60
    ds = GPTDataset(corpus, (first, last), SEQ, seed=1, cache_dir=None)
    seen = np.unique(np.concatenate([ds[i] for i in range(len(ds))]))
    expected = np.concatenate([corpus[d] for d in range(first, last)])
    # the split's tokens, minus a tail shorter than one sample
    assert len(expected) - len(seen) < SEQ
    assert np.isin(seen, expected).all()
    full = GPTDataset(corpus, (0, 60), SEQ, seed=1)  # whole corpus sized so that no tail is left over
    seen = np.unique(np.concatenate([full[i] for i in range(len(full))]))
    np.testing.assert_array_equal(seen, np.arange(corpus.num_tokens))


def test_full_epochs_come_first_when_the_last_is_small(corpus):
    per_epoch = (corpus.num_tokens - 1) // SEQ
    ds = GPTDataset(corpus, (0, 60), SEQ, seed=2, num_samples=2 * per_epoch + 3)
    before_final = (2 * corpus.num_tokens - 1) // SEQ  # samples that lie wholly in the first two epochs
    assert sorted(ds.shuffle_index[:before_final].tolist()) == list(range(before_final))


def test_indices_are_reused_from_cache(corpus, tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    first = GPTDataset(corpus, (0, 50), SEQ, seed=7, num_samples=100, cache_dir=cache)
    assert first.indices_built

    def no_rebuild(*a, **k):
        raise AssertionError("indices rebuilt although cached")

    monkeypatch.setattr(gpt_dataset, "build_gpt_indices", no_rebuild)
    second = GPTDataset(corpus, (0, 50), SEQ, seed=7, num_samples=100, cache_dir=cache)
    assert not second.indices_built
    assert all(np.array_equal(first[i], second[i]) for i in range(len(first)))
    with pytest.raises(AssertionError, match="rebuilt"):  # anything that defines the indices changes the key
        GPTDataset(corpus, (0, 50), SEQ, seed=8, num_samples=100, cache_dir=cache)


def test_deterministic_and_seed_dependent(corpus):
    a, b = (GPTDataset(corpus, (0, 60), SEQ, seed=s) for s in (1, 1))
    c = GPTDataset(corpus, (0, 60), SEQ, seed=2)
    assert np.array_equal(a.shuffle_index, b.shuffle_index)
    assert not np.array_equal(a.document_index, c.document_index)
