"""Weighted mixture of datasets, deterministic, following the requested weights at every prefix."""

from __future__ import annotations

import numpy as np

from megand.data.index_cache import load_or_build


def build_blending_indices(weights, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy assignment: sample ``t`` goes to the dataset furthest behind its share.

    Returns ``(dataset_index, dataset_sample_index)``. Picking the largest error ``w_i * t - count_i``
    keeps every count within one sample of ``w_i * t`` at every prefix. The choice at ``t`` depends on
    all previous ones, so this is a sequential loop, kept to plain Python scalars (about 0.7 us/sample
    for three datasets); the result is cached.
    """
    w = np.asarray(weights, dtype=np.float64)
    w = (w / w.sum()).tolist()
    counts = [0] * len(w)
    dataset_index = np.zeros(size, dtype=np.int16)
    sample_index = np.zeros(size, dtype=np.int64)
    choice, nth = [0] * size, [0] * size
    candidates = range(1, len(w))
    for t in range(size):
        td = t if t > 0 else 1  # Megatron uses max(t, 1)
        best, best_err = 0, w[0] * td - counts[0]
        for i in candidates:
            err = w[i] * td - counts[i]
            if err > best_err:
                best, best_err = i, err
        choice[t], nth[t] = best, counts[best]
        counts[best] += 1
    dataset_index[:] = choice
    sample_index[:] = nth
    return dataset_index, sample_index


def samples_needed(weights, size: int) -> list[int]:
    """Upper bound on what each dataset contributes to ``size`` blended samples (greedy error < 1)."""
    w = np.asarray(weights, dtype=np.float64)
    return [int(np.ceil(x * size)) + 1 for x in w / w.sum()]


class BlendedDataset:
    """``num_samples`` samples drawn from ``datasets`` in proportion to ``weights``."""

    def __init__(self, datasets: list, weights, num_samples: int, cache_dir: str | None = None, name: str = "train"):
        self.datasets = datasets
        self.weights = [float(x) for x in weights]
        description = {"kind": "blending_indices", "version": 1, "weights": self.weights, "size": num_samples}
        arrays, self.indices_built = load_or_build(
            cache_dir, f"blend-{name}", description,
            lambda: dict(zip(("dataset_index", "dataset_sample_index"),
                             build_blending_indices(self.weights, num_samples))))
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        counts = np.bincount(self.dataset_index, minlength=len(datasets))
        for ds, need in zip(datasets, counts):
            if need > len(ds):
                raise ValueError(f"blend needs {need} samples from a dataset of {len(ds)}")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]
