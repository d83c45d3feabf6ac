"""What a run trains on: the registry of data sources, one record per ``data.kind``.

A source is one of two kinds of access, and the trainer reads either through the same feed interface
(``megand.training.feeds``):

- random access (indexed datasets, mock data, blends): sample ``j`` of the global stream is
  ``dataset[j]``, whatever reads it; the position is the number of samples consumed;
- streaming (:class:`megand.data.stream.StreamSource` and its subclasses): samples come out in order, one
  lane per slot of the global batch, and the position cannot be computed from a sample number; the state
  says where every lane stands and which files it read.

Either way the state is a dict of plain Python values (numbers, strings, lists, dicts) that a checkpoint
stores as it is. Adding a source is one module with its builder, and one :class:`DataKind` line below.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from megand.data.errors import DataError

RANDOM_ACCESS, STREAM = "random_access", "stream"


@dataclass(frozen=True)
class DataKind:
    """One ``data.kind``: how its splits are built and how they are read."""

    name: str
    builder: str  # "module:function", (data_cfg, seq_length, vocab_size, seed, num_samples) -> (train, valid, test)
    access: str  # RANDOM_ACCESS: dataset[j] is sample j; STREAM: a StreamSource, read in order lane by lane
    paths: str | None = None  # what X names in a data.paths entry [weight, X]; None: data.paths is not read
    # "module:function", (data_cfg, vocab_size) -> the tokenizer file a source brings itself when
    # data.tokenizer is null (what export and generation use as the run's tokenizer); None: it brings none
    own_tokenizer: str | None = None

    def build(self, data_cfg, seq_length: int, vocab_size: int, seed: int, num_samples: tuple[int, int, int]):
        """``(train, valid, test)``; a split asked for 0 samples is ``None``."""
        module, function = self.builder.split(":")
        return getattr(importlib.import_module(module), function)(data_cfg, seq_length, vocab_size, seed, num_samples)

    def tokenizer_of(self, data_cfg, vocab_size: int) -> str | None:
        """The tokenizer file this source brought itself to a run of ``data_cfg`` (None when it brings none)."""
        if self.own_tokenizer is None:
            return None
        module, function = self.own_tokenizer.split(":")
        return getattr(importlib.import_module(module), function)(data_cfg, vocab_size)


DATA_KINDS: dict[str, DataKind] = {kind.name: kind for kind in (
    DataKind("mock", "megand.data.builder:build_mock", RANDOM_ACCESS),
    DataKind("indexed", "megand.data.builder:build_indexed", RANDOM_ACCESS, "prefix"),
    DataKind("quickstart", "megand.data.builder:build_quickstart", RANDOM_ACCESS,
             own_tokenizer="megand.data.quickstart:quickstart_tokenizer"),
    DataKind("stream", "megand.data.stream:build_stream", STREAM, "directory or glob"),
    DataKind("hf_disk", "megand.data.hf_disk:build_hf_disk", STREAM, "directory written by save_to_disk"),
)}


def data_kind(name: str) -> DataKind:
    if name not in DATA_KINDS:
        raise DataError(f"data.kind={name!r}: expected one of {', '.join(map(repr, DATA_KINDS))}")
    return DATA_KINDS[name]
