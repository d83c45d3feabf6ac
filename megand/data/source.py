"""What a run trains on: a data source, and the registry that maps ``data.kind`` to its builder.

Two kinds of source sit behind one small interface, :class:`DataSource`:

- random access (indexed datasets, mock data, blends): sample ``j`` of the global stream is
  ``dataset[j]``, whatever reads it; the state is the next global sample to read;
- streaming (:mod:`megand.data.stream`): samples come out in order and the position cannot be computed
  from a sample number; the state says where every reader stands.

Either way the state is a dict of plain Python values (numbers, strings, lists, dicts) that a checkpoint
stores as it is and :meth:`DataSource.load_state_dict` takes back, also at another data-parallel size.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from megand.data.errors import DataError


class DataSource(ABC):
    """A source of fixed-length token samples whose position a checkpoint keeps."""

    is_stream: bool = False

    @abstractmethod
    def state_dict(self) -> dict: ...

    @abstractmethod
    def load_state_dict(self, state: dict) -> None: ...


class RandomAccessSource(DataSource):
    """A map-style dataset (``len``, ``dataset[j]`` -> ``seq_length + 1`` tokens) and the next global sample
    to read. Reading by index needs no other state, so any layout resumes it exactly."""

    def __init__(self, dataset, next_sample: int = 0):
        self.dataset, self.next_sample = dataset, int(next_sample)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int):
        return self.dataset[idx]

    def state_dict(self) -> dict:
        return {"kind": "random_access", "next_sample": self.next_sample}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "random_access":
            raise DataError(f"the checkpoint's data state is of kind {state.get('kind')!r}, this run reads a "
                            f"random-access dataset (data.kind changed since the checkpoint?)")
        self.next_sample = int(state["next_sample"])


# data.kind -> builder(data_cfg, seq_length, vocab_size, seed, num_samples) -> (train, valid, test)
DATA_KINDS: dict[str, Callable] = {}


def register_kind(name: str):
    """Register the builder of ``data.kind=name`` (a decorator)."""
    def add(builder):
        DATA_KINDS[name] = builder
        return builder
    return add


def builder_of(kind: str) -> Callable:
    if kind not in DATA_KINDS:
        raise DataError(f"data.kind={kind!r}: expected one of {', '.join(map(repr, sorted(DATA_KINDS)))}")
    return DATA_KINDS[kind]
