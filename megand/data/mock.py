"""Deterministic synthetic data: learnable token sequences that need no files."""

import numpy as np


class MockGPTDataset:
    """Sample ``i`` is ``seq_length + 1`` tokens of an arithmetic progression modulo the vocab.

    Start and stride are drawn from a generator seeded by (seed, i), so the sample depends only on its
    index: every parallel layout sees the same data. The pattern is learnable, so loss falls quickly.
    ``offset`` separates splits (train, valid, test draw disjoint index ranges).
    """

    def __init__(self, seq_length: int, vocab_size: int, seed: int, num_samples: int, offset: int = 0):
        self.seq_length, self.vocab_size, self.seed = seq_length, vocab_size, seed
        self.num_samples, self.offset = num_samples, offset

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.offset + idx])
        start, stride = rng.integers(self.vocab_size), rng.integers(1, 8)
        return (start + stride * np.arange(self.seq_length + 1, dtype=np.int64)) % self.vocab_size
