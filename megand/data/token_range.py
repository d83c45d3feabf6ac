"""The range of token ids a dataset holds, found by one scan of its ``.bin`` and cached with the indices.

A dataset tokenized with a larger vocabulary than the model's would index past the embedding: at tp=1
an IndexError deep in the forward, at tp>1 (each rank masks the ids outside its vocabulary shard)
silently wrong training. Checking the largest id when the dataset loads makes both one clear line.
"""

from __future__ import annotations

import os

import numpy as np

from megand.data.errors import DataError
from megand.data.index_cache import load_or_build
from megand.data.indexed_dataset import IndexedDataset, bin_path

_SCAN_BLOCK = 1 << 24  # tokens read at a time


def scan_token_range(ds: IndexedDataset) -> np.ndarray:
    """``[min, max]`` of every token id in the dataset (``[0, -1]`` when it holds no tokens)."""
    tokens = ds.tokens
    if len(tokens) == 0:
        return np.array([0, -1], dtype=np.int64)
    low, high = int(tokens[0]), int(tokens[0])
    for start in range(0, len(tokens), _SCAN_BLOCK):  # one pass, one block in memory at a time
        block = np.asarray(tokens[start:start + _SCAN_BLOCK])
        low, high = min(low, int(block.min())), max(high, int(block.max()))
    return np.array([low, high], dtype=np.int64)


def token_range(ds: IndexedDataset, cache_dir: str | None) -> tuple[int, int]:
    """The dataset's ``(min, max)`` token id: scanned once, then read from ``cache_dir``."""
    path = bin_path(ds.prefix)
    stat = os.stat(path)
    description = {"kind": "token_range", "version": 1, "bin": os.path.realpath(path), "bytes": stat.st_size,
                   "mtime_ns": stat.st_mtime_ns}  # a rewritten file is scanned again
    arrays, _ = load_or_build(cache_dir, "token-range", description, lambda: {"range": scan_token_range(ds)})
    low, high = (int(x) for x in arrays["range"])
    return low, high


def check_token_ids(ds: IndexedDataset, vocab_size: int, cache_dir: str | None) -> None:
    """DataError naming the file and the values when a token id falls outside ``[0, vocab_size)``."""
    low, high = token_range(ds, cache_dir)
    if high >= vocab_size:
        raise DataError(f"{bin_path(ds.prefix)}: holds token ids up to {high}, not below model.vocab_size="
                        f"{vocab_size} (tokenized with a larger vocabulary? set model.vocab_size >= {high + 1} "
                        f"or use the matching data.tokenizer)")
    if low < 0:
        raise DataError(f"{bin_path(ds.prefix)}: holds a negative token id ({low})")
