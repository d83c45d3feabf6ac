"""The training loop's batch prefetcher: the next step is read on a background thread, the same batches
come out, the dataset is never read by two threads at once, and read errors reach the step that asked."""

import threading
import time

import pytest
import torch

from megand.training.batches import MicroBatch, Prefetcher


class Reader:
    """A step's one micro-batch of token ids ``iteration * 10 + offset``, slow enough to overlap."""

    def __init__(self, fail_at=None):
        self.calls, self.threads, self.active, self.most_active = [], set(), 0, 0
        self.fail_at, self.lock = fail_at, threading.Lock()

    def __call__(self, iteration, offset):
        with self.lock:
            self.active += 1
            self.most_active = max(self.most_active, self.active)
        try:
            self.calls.append((iteration, offset))
            self.threads.add(threading.get_ident())
            time.sleep(0.02)
            if iteration == self.fail_at:
                raise ValueError(f"sample of step {iteration} is corrupt")
            ids = torch.full((1, 4), iteration * 10 + offset)
            return [MicroBatch(ids, ids, torch.arange(4), 1)]
        finally:
            with self.lock:
                self.active -= 1


def test_reads_the_next_step_on_another_thread_and_returns_the_same_batches():
    reader = Reader()
    prefetcher = Prefetcher(reader, torch.device("cpu"))
    for step in range(4):
        batch = prefetcher.get(step, 0)
        assert batch[0].input_ids.flatten().tolist() == [step * 10] * 4
        time.sleep(0.1)  # this step computes
        assert (step + 1, 0) in reader.calls  # meanwhile the following step is being read
    prefetcher.close()
    assert reader.calls.count((2, 0)) == 1  # each step read once
    assert len(reader.threads - {threading.get_ident()}) == 1


def test_another_step_than_the_one_read_ahead_is_read_directly_never_concurrently():
    reader = Reader()
    prefetcher = Prefetcher(reader, torch.device("cpu"))
    prefetcher.get(0, 0)  # reads 1 ahead
    assert prefetcher.get(0, 5)[0].input_ids[0, 0].item() == 5  # a changed offset (e.g. a rollback)
    assert prefetcher.get(7, 5)[0].input_ids[0, 0].item() == 75  # a jump (e.g. a resume)
    assert prefetcher.get(8, 5)[0].input_ids[0, 0].item() == 85
    prefetcher.close()
    assert reader.most_active == 1


def test_a_read_error_is_raised_by_the_step_that_asks_for_it():
    reader = Reader(fail_at=2)
    prefetcher = Prefetcher(reader, torch.device("cpu"))
    prefetcher.get(1, 0)  # the read ahead of step 2 fails in the background: nothing raised yet
    with pytest.raises(ValueError, match="step 2 is corrupt"):
        prefetcher.get(2, 0)
    prefetcher.close()


def test_a_failed_read_ahead_that_nobody_asks_for_is_dropped():
    reader = Reader(fail_at=3)  # e.g. the step after the last one runs past the data
    prefetcher = Prefetcher(reader, torch.device("cpu"))
    prefetcher.get(2, 0)
    prefetcher.close()  # no error
