"""Megatron-LM compatible indexed dataset: ``PREFIX.bin`` (tokens) + ``PREFIX.idx`` (index), memory-mapped.

``.idx`` layout (all little-endian), identical to Megatron-LM's ``MMapIndexedDataset`` version 1:

    b"MMIDIDX\\x00\\x00"      9-byte magic
    uint64 version          always 1
    uint8  dtype code       see ``DTYPE_CODES``
    uint64 sequence count   n
    uint64 document count   d (= number of documents + 1: the array starts with 0)
    int32[n]  sequence lengths (tokens)
    int64[n]  sequence pointers (byte offsets into .bin)
    int64[d]  document indices (sequence index where each document starts, then the total)

``.bin`` is the tokens of every sequence back to back in that dtype. Our preprocessing writes one
sequence per document; Megatron's GPT dataset (and ours) treats each sequence as a document.
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Iterable

import numpy as np

from megand.data.errors import DataError

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
_HEADER_BYTES = len(INDEX_HEADER) + 8 + 1 + 8 + 8  # magic, version, dtype code, two counts = 34

# Megatron-LM's dtype codes (megatron/core/datasets/indexed_dataset.py: DType).
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
               6: np.float64, 7: np.float32, 8: np.uint16}
_CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def token_dtype(vocab_size: int) -> type[np.number]:
    """Smallest token dtype Megatron would pick: uint16 below 65500 entries, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def write_index(path: str, dtype, sequence_lengths: np.ndarray, document_indices: np.ndarray) -> None:
    """Write an ``.idx`` file; pointers are derived from the lengths and the dtype size."""
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    docs = np.asarray(document_indices, dtype=np.int64)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= np.dtype(dtype).itemsize
    with open(path, "wb") as f:
        f.write(INDEX_HEADER)
        f.write(struct.pack("<Q", INDEX_VERSION))
        f.write(struct.pack("<B", _CODE_OF[np.dtype(dtype)]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(docs)))
        f.write(lengths.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(docs.astype("<i8").tobytes())


_CHECK_BLOCK = 1 << 22  # index entries checked at a time: memory stays bounded whatever the dataset size


def check_index(ipath: str, lengths: np.ndarray, pointers: np.ndarray, documents: np.ndarray, itemsize: int) -> None:
    """An index whose parts contradict each other (a flipped bit, a bad writer) fails here, naming the entry:
    sizes non-negative, each pointer the sum of the sizes before it, document starts non-decreasing from
    0 to the number of sequences. One pass over the index (never the tokens)."""
    n, byte = len(lengths), 0
    for start in range(0, n, _CHECK_BLOCK):
        sizes = np.asarray(lengths[start:start + _CHECK_BLOCK], dtype=np.int64)
        negative = np.flatnonzero(sizes < 0)
        if negative.size:
            i = start + int(negative[0])
            raise DataError(f"{ipath}: corrupted index: sequence_lengths[{i}]={int(lengths[i])} is negative")
        expected = byte + np.concatenate(([0], np.cumsum(sizes[:-1]))) * itemsize
        wrong = np.flatnonzero(np.asarray(pointers[start:start + _CHECK_BLOCK]) != expected)
        if wrong.size:
            i = start + int(wrong[0])
            raise DataError(f"{ipath}: corrupted index: sequence_pointers[{i}]={int(pointers[i])} but the sizes of "
                            f"sequences 0..{i - 1} add up to byte {int(expected[wrong[0]])} (a damaged size or "
                            f"pointer at or before sequence {i})")
        byte = int(expected[-1] + sizes[-1] * itemsize)
    if len(documents) == 0 or documents[0] != 0 or documents[-1] != n:
        ends = f"{int(documents[0])}..{int(documents[-1])}" if len(documents) else "empty"
        raise DataError(f"{ipath}: corrupted index: document_indices run {ends}, expected 0..{n} (the number "
                        f"of sequences)")
    for start in range(0, len(documents) - 1, _CHECK_BLOCK):
        block = np.asarray(documents[start:start + _CHECK_BLOCK + 1])
        down = np.flatnonzero(np.diff(block) < 0)
        if down.size:
            i = start + int(down[0]) + 1
            raise DataError(f"{ipath}: corrupted index: document_indices[{i}]={int(documents[i])} is smaller than "
                            f"document_indices[{i - 1}]={int(documents[i - 1])}")


class IndexedDataset:
    """Random access to the sequences of a ``.bin``/``.idx`` pair without reading them into memory.

    Opening validates the pair: both files exist, the header is Megatron's, the ``.idx`` size matches
    its counts and the ``.bin`` size matches the index. Problems raise ``DataError`` naming the file.
    """

    def __init__(self, prefix: str):
        self.prefix = str(prefix)
        self._open()

    def _open(self) -> None:
        ipath, bpath = idx_path(self.prefix), bin_path(self.prefix)
        for p in (ipath, bpath):
            if not os.path.isfile(p):
                stem, ext = os.path.splitext(self.prefix)
                hint = (f"; give the prefix without the extension: {stem}"
                        if ext in (".bin", ".idx") and os.path.isfile(idx_path(stem)) else "")
                raise DataError(f"{p}: missing (an indexed dataset needs both {self.prefix}.bin and .idx){hint}")
        with open(ipath, "rb") as f:
            head = f.read(_HEADER_BYTES)
        if len(head) < _HEADER_BYTES or head[:9] != INDEX_HEADER:
            raise DataError(f"{ipath}: not a Megatron indexed-dataset index (bad MMIDIDX header)")
        version, code, n, d = struct.unpack("<QBQQ", head[9:])
        if version != INDEX_VERSION or code not in DTYPE_CODES:
            raise DataError(f"{ipath}: unsupported index version {version} or dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = _HEADER_BYTES + 4 * n + 8 * n + 8 * d
        actual = os.path.getsize(ipath)
        # Megatron's multimodal variant appends one int8 mode per sequence; accept and ignore it.
        if actual not in (expected, expected + n):
            raise DataError(f"{ipath}: size {actual} bytes does not match its header ({n} sequences, "
                            f"{d} document entries: expected {expected})")
        self._idx = np.memmap(ipath, mode="r", dtype=np.uint8)
        self.sequence_lengths = np.frombuffer(self._idx, np.int32, n, _HEADER_BYTES)
        self.sequence_pointers = np.frombuffer(self._idx, np.int64, n, _HEADER_BYTES + 4 * n)
        self.document_indices = np.frombuffer(self._idx, np.int64, d, _HEADER_BYTES + 12 * n)
        check_index(ipath, self.sequence_lengths, self.sequence_pointers, self.document_indices, self.dtype.itemsize)
        data_bytes = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize if n else 0
        bin_size = os.path.getsize(bpath)
        if bin_size != data_bytes:
            raise DataError(f"{ipath} does not match {bpath}: the index describes {data_bytes} bytes of "
                            f"tokens, the .bin holds {bin_size}")
        # np.memmap refuses empty files; an empty dataset simply has no tokens.
        self._bin = np.memmap(bpath, mode="r", dtype=self.dtype) if bin_size else np.empty(0, self.dtype)

    # Pickle by path so DataLoader workers reopen the maps instead of copying them.
    def __getstate__(self):
        return {"prefix": self.prefix}

    def __setstate__(self, state):
        self.prefix = state["prefix"]
        self._open()

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return len(self._bin)

    @property
    def tokens(self) -> np.ndarray:
        """Every token of the dataset, back to back (a read-only map of the ``.bin``)."""
        return self._bin

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (a read-only view of the map)."""
        start = int(self.sequence_pointers[idx]) // self.dtype.itemsize + offset
        if length is None:
            length = int(self.sequence_lengths[idx]) - offset
        return self._bin[start:start + length]

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)


class IndexedDatasetWriter:
    """Appends documents to ``PREFIX.bin``; ``finalize()`` writes ``PREFIX.idx``.

    The index is written last, so an interrupted run leaves no ``.idx`` and cannot be mistaken for a
    complete dataset. Memory held: 4 bytes per sequence (the lengths), never the tokens.
    """

    def __init__(self, prefix: str, dtype):
        self.prefix, self.dtype = str(prefix), np.dtype(dtype)
        self._bin = open(bin_path(self.prefix), "wb")
        self._lengths: list[np.ndarray] = []
        self._doc_starts: list[np.ndarray] = [np.zeros(1, np.int64)]
        self._num_sequences = 0

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents given as one flat token array and the length of each document."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.sum() != len(tokens):
            raise ValueError("document lengths do not add up to the number of tokens")
        self._bin.write(np.asarray(tokens).astype(self.dtype, copy=False).tobytes())
        self._lengths.append(lengths.astype(np.int32))
        self._doc_starts.append(self._num_sequences + np.arange(1, len(lengths) + 1, dtype=np.int64))
        self._num_sequences += len(lengths)

    def add_document(self, tokens: Iterable[int]) -> None:
        tokens = np.asarray(list(tokens) if not isinstance(tokens, np.ndarray) else tokens)
        self.add_documents(tokens, [len(tokens)])

    def add_dataset(self, prefix: str) -> None:
        """Append a whole existing dataset (same dtype), keeping its document boundaries."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise DataError(f"{idx_path(prefix)}: dtype {other.dtype} differs from {self.dtype}; cannot merge")
        self._lengths.append(np.array(other.sequence_lengths, dtype=np.int32))
        self._doc_starts.append(self._num_sequences + np.array(other.document_indices[1:], dtype=np.int64))
        self._num_sequences += len(other)
        with open(bin_path(prefix), "rb") as f:
            shutil.copyfileobj(f, self._bin, 16 << 20)

    def abort(self) -> None:
        """Stop writing and delete the partial ``.bin`` (there is no ``.idx`` yet)."""
        self._bin.close()
        if os.path.exists(bin_path(self.prefix)):
            os.remove(bin_path(self.prefix))

    def finalize(self) -> None:
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        write_index(idx_path(self.prefix), self.dtype, lengths, np.concatenate(self._doc_starts))


def merge_datasets(prefixes: list[str], output_prefix: str) -> None:
    """Concatenate indexed datasets (e.g. the partitions of one preprocessing run) into one."""
    if not prefixes:
        raise ValueError("nothing to merge")
    dtype = IndexedDataset(prefixes[0]).dtype
    with IndexedDatasetWriter(output_prefix, dtype) as out:
        for p in prefixes:
            out.add_dataset(p)
