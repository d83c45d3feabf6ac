import numpy as np
import pytest

from megand.data.blended_dataset import BlendedDataset, build_blending_indices, samples_needed


def reference_greedy(weights, size):
    """Megatron's helpers.cpp build_blending_indices, transcribed literally."""
    w = np.asarray(weights, float) / sum(weights)
    counts = np.zeros(len(w), dtype=np.int64)
    out = []
    for t in range(size):
        err = w * max(t, 1.0) - counts
        i = int(np.argmax(err))
        out.append((i, counts[i]))
        counts[i] += 1
    return out


@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [1, 9], [0.1, 0.2, 0.3, 0.4], [3.0]])
def test_realised_mix_within_one_percent(weights):
    w = np.asarray(weights) / sum(weights)
    dataset_index, _ = build_blending_indices(weights, 10_000)
    for n in (1_000, 10_000):
        realised = np.bincount(dataset_index[:n], minlength=len(w)) / n
        assert np.abs(realised - w).max() <= 0.01
    counts = np.cumsum(np.eye(len(w), dtype=np.int64)[dataset_index], axis=0)
    ideal = np.outer(np.arange(1, 10_001), w)
    assert np.abs(counts - ideal).max() <= 1  # within one sample at every prefix
    assert (counts[-1] <= samples_needed(weights, 10_000)).all()


def test_matches_megatron_greedy():
    dataset_index, sample_index = build_blending_indices([0.1, 0.2, 0.3, 0.4], 500)
    assert list(zip(dataset_index.tolist(), sample_index.tolist())) == reference_greedy([0.1, 0.2, 0.3, 0.4], 500)


def test_blended_dataset_is_deterministic_and_cached(tmp_path):
    a = [np.full(3, 0, np.int64)] * 100
    b = [np.full(3, 1, np.int64)] * 100
    first = BlendedDataset([a, b], [0.25, 0.75], 120, cache_dir=str(tmp_path))
    second = BlendedDataset([a, b], [0.25, 0.75], 120, cache_dir=str(tmp_path))
    assert first.indices_built and not second.indices_built
    picks = [int(first[i][0]) for i in range(len(first))]
    assert picks == [int(second[i][0]) for i in range(len(second))]
    assert picks.count(0) == 30
    with pytest.raises(ValueError, match="needs"):
        BlendedDataset([a[:10], b], [0.25, 0.75], 120)
