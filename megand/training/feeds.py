"""Feeds: how the trainer reads every data source, through one interface whatever its kind.

A feed gives this rank the micro-batches of the step that starts after ``consumed`` samples and keeps the
position a checkpoint saves::

    get(consumed, read_ahead=True) -> [MicroBatch]   the step's micro-batches (then reads the next step's)
    restart()                                        back to the start (a validation feed, at each evaluation)
    reserve(samples)                                 collective: the run reads up to ``samples`` samples
    state_dict() -> dict                             collective: the position, for the checkpoint
    load_state_dict(state | None) -> notice | None   collective: a checkpoint's position (checked)
    close()

The source's access (its record in :data:`megand.data.source.DATA_KINDS`) picks the feed: random-access
datasets (:class:`RandomAccessFeed`) or streams (:class:`megand.training.batches.StreamBatches`).
"""

from __future__ import annotations

import torch

from megand.data.source import RANDOM_ACCESS, STREAM, data_kind
from megand.training.batches import Prefetcher, StreamBatches, rank_microbatches


class RandomAccessFeed:
    """A map-style dataset: the step after ``consumed`` samples is samples ``[consumed, consumed + b)``
    (``b`` the step's global batch), read ahead on a background thread. The position is the samples
    consumed, which the checkpoint keeps anyway, so any layout and global batch size resumes exactly.

    ``rebuild(samples)``: the dataset built again to hold ``samples`` samples (collective), when a resume
    at a smaller global batch size reads further than the dataset was built for (``capacity``)."""

    def __init__(self, dataset, topo, micro_batch_size: int, batch_needs: dict, ramp, capacity: int = 0,
                 rebuild=None):
        self.source, self.topo, self.micro_batch_size, self.batch_needs = dataset, topo, micro_batch_size, batch_needs
        self.ramp, self.capacity, self.rebuild = ramp, capacity, rebuild
        self.next_sample = 0
        self.prefetcher = Prefetcher(self._read, topo.device, self._following)

    def _read(self, consumed: int, dataset):
        """This rank's micro-batches of the step after ``consumed`` samples, on the host."""
        return rank_microbatches(dataset, 0, self.ramp.batch_size(consumed), self.micro_batch_size, self.topo,
                                 offset=consumed, device=torch.device("cpu"), **self.batch_needs)

    def _following(self, key):
        consumed, dataset = key
        return consumed + self.ramp.batch_size(consumed), dataset

    def get(self, consumed: int, read_ahead: bool = True) -> list:
        self.next_sample = consumed + self.ramp.batch_size(consumed)
        return self.prefetcher.get(consumed, self.source, read_ahead=read_ahead)

    def restart(self) -> None:
        """Nothing to do: every step is read by its sample numbers."""

    def reserve(self, samples: int) -> None:
        if samples > self.capacity and self.rebuild is not None:
            self.source, self.capacity = self.rebuild(samples), samples

    def state_dict(self) -> dict:
        return {"kind": RANDOM_ACCESS, "next_sample": self.next_sample}

    def load_state_dict(self, state: dict | None) -> None:
        """The position is the checkpoint's consumed samples (what :meth:`get` is asked for): nothing to check."""
        if state is not None and state.get("kind") == RANDOM_ACCESS:
            self.next_sample = int(state["next_sample"])
        return None

    def close(self) -> None:
        self.prefetcher.close()


def _stream_feed(source, topo, micro_batch_size, batch_needs, ramp, capacity, rebuild):
    return StreamBatches(source, topo, ramp.final, micro_batch_size, **batch_needs, ramp=ramp)


FEEDS = {RANDOM_ACCESS: RandomAccessFeed, STREAM: _stream_feed}  # a DataKind's access -> its feed


def open_feed(kind: str, source, topo, micro_batch_size: int, batch_needs: dict, ramp, capacity: int = 0,
              rebuild=None):
    """The feed of ``source``, a split of ``data.kind=kind`` (None: a split the run does not read).
    ``ramp``: the global batch size of each step (a validation feed: a constant one)."""
    if source is None:
        return None
    return FEEDS[data_kind(kind).access](source, topo, micro_batch_size, batch_needs, ramp, capacity, rebuild)
