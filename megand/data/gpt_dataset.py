"""GPT pretraining samples: fixed-length windows over a shuffled stream of documents (Megatron semantics).

Three indices, built once with numpy and cached:
- document index: the split's document ids repeated once per epoch, each epoch shuffled;
- sample index: ``(position in document index, token offset)`` where each sample starts; sample ``j``
  spans stream tokens ``[j * seq_length, (j + 1) * seq_length]`` (``seq_length + 1`` tokens, so
  consecutive samples share one token: the last label of one is the first input of the next);
- shuffle index: the order in which samples are served.

As in Megatron, when the last epoch is needed for less than 80% of its samples it is shuffled
separately, so the full epochs before it are served first and completely.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from megand.data.index_cache import load_or_build
from megand.data.indexed_dataset import IndexedDataset

_INDEX_VERSION = 1  # bump when the index construction changes, to invalidate caches
_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.8


def samples_per_epoch(num_tokens: int, seq_length: int) -> int:
    return max(0, (num_tokens - 1) // seq_length)


def build_gpt_indices(sequence_lengths: np.ndarray, document_ids: np.ndarray, seq_length: int,
                      num_samples: int | None, seed: int) -> dict[str, np.ndarray]:
    """Document, sample and shuffle indices for ``num_samples`` samples (None: one epoch)."""
    tokens_per_epoch = int(sequence_lengths[document_ids].sum(dtype=np.int64))
    per_epoch = samples_per_epoch(tokens_per_epoch, seq_length)
    if per_epoch < 1:
        raise ValueError(f"{tokens_per_epoch} tokens cannot make one sample of {seq_length + 1} tokens")
    num_samples = per_epoch if num_samples is None else int(num_samples)
    num_epochs = -(-(num_samples * seq_length + 1) // tokens_per_epoch)  # ceil
    before_final = samples_per_epoch((num_epochs - 1) * tokens_per_epoch, seq_length)
    separate_final = num_epochs > 1 and num_samples - before_final < _SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch

    rng = np.random.default_rng(seed)
    document_index = _document_index(np.asarray(document_ids), num_epochs, separate_final, rng)
    total = samples_per_epoch(num_epochs * tokens_per_epoch, seq_length)
    sample_index = _sample_index(sequence_lengths[document_index], seq_length, total)
    if separate_final:
        shuffle_index = np.concatenate([rng.permutation(before_final),
                                        before_final + rng.permutation(total - before_final)])
    else:
        shuffle_index = rng.permutation(total)
    index_dtype = np.uint32 if total < 2**32 else np.int64
    return {"document_index": document_index, "sample_index": sample_index,
            "shuffle_index": shuffle_index[:num_samples].astype(index_dtype)}


def _document_index(document_ids: np.ndarray, num_epochs: int, separate_final: bool, rng) -> np.ndarray:
    dtype = np.int32 if len(document_ids) == 0 or document_ids.max() < 2**31 else np.int64
    index = np.tile(document_ids.astype(dtype), num_epochs)
    if separate_final:
        cut = (num_epochs - 1) * len(document_ids)
        rng.shuffle(index[:cut])
        rng.shuffle(index[cut:])
    else:
        rng.shuffle(index)
    return index


def _sample_index(stream_lengths: np.ndarray, seq_length: int, num_samples: int) -> np.ndarray:
    """Rows ``(i, offset)``: sample ``j`` starts at token ``offset`` of the ``i``-th document of the stream.

    Row ``j + 1`` is where sample ``j`` ends (inclusive). Found by binary search of each start
    position in the cumulative document lengths; zero-length documents are never landed on.
    """
    starts = np.zeros(len(stream_lengths) + 1, dtype=np.int64)
    np.cumsum(stream_lengths, dtype=np.int64, out=starts[1:])
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    doc = np.searchsorted(starts, positions, side="right") - 1
    offset = positions - starts[doc]
    dtype = np.int32 if len(stream_lengths) < 2**31 else np.int64
    return np.stack([doc, offset], axis=1).astype(dtype)


class GPTDataset:
    """Samples of ``seq_length + 1`` tokens from documents ``[first, last)`` of an indexed dataset.

    ``indices_built`` tells whether this construction computed the indices (False: loaded from cache).
    """

    def __init__(self, indexed: IndexedDataset, document_range: tuple[int, int], seq_length: int, seed: int,
                 num_samples: int | None = None, cache_dir: str | None = None, name: str = "train"):
        self.indexed, self.seq_length, self.name = indexed, seq_length, name
        first, last = document_range
        self.description = {
            "kind": "gpt_indices", "version": _INDEX_VERSION, "prefix": os.path.realpath(indexed.prefix),
            # content, not mtime: a copied dataset reuses its cache, a regenerated one does not
            "lengths_sha": hashlib.sha256(np.ascontiguousarray(indexed.sequence_lengths[first:last])).hexdigest(),
            "documents": [int(first), int(last)], "seq_length": seq_length, "seed": seed,
            "num_samples": num_samples,
        }
        arrays, self.indices_built = load_or_build(
            cache_dir, f"gpt-{name}", self.description,
            lambda: build_gpt_indices(indexed.sequence_lengths, np.arange(first, last), seq_length, num_samples, seed))
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def __getitem__(self, idx: int) -> np.ndarray:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        j = int(self.shuffle_index[idx])
        (d0, o0), (d1, o1) = self.sample_index[j], self.sample_index[j + 1]
        get, docs = self.indexed.get, self.document_index
        if d0 == d1:
            tokens = get(int(docs[d0]), int(o0), int(o1 - o0 + 1))
        else:
            parts = [get(int(docs[d0]), int(o0))]
            parts += [get(int(docs[d])) for d in range(d0 + 1, d1)]
            parts.append(get(int(docs[d1]), 0, int(o1 + 1)))
            tokens = np.concatenate(parts)
        return tokens.astype(np.int64)
