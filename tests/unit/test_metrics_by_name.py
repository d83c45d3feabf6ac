"""Per-step metrics by name: each rank declares its values with their rule, in any order; the ranks agree
on the packing (by name) and combine them in as few collectives as the rules allow. Two ranks are two
threads here, their collectives meeting at a barrier."""

import threading

import pytest
import torch
import torch.distributed as dist

from megand.core import metrics as metrics_module
from megand.core.metrics import MAX, MEAN, RANKS, SUM, Metric, reduce_metrics


class TwoRanks:
    """Two ranks as threads whose collectives combine their tensors; ``calls``: each rank's collectives."""

    def __init__(self, monkeypatch):
        self.barrier, self.slots, self.calls = threading.Barrier(2), [None, None], [[], []]
        self.local = threading.local()
        monkeypatch.setattr(metrics_module.dist, "all_reduce", self.all_reduce)
        monkeypatch.setattr(metrics_module, "all_gather_flat", self.all_gather)

    def _both(self, tensor):
        self.slots[self.local.rank] = tensor.clone()
        self.barrier.wait()
        both = list(self.slots)
        self.barrier.wait()  # both read before either's next collective writes its slot
        return both

    def all_reduce(self, tensor, op, group=None):
        self.calls[self.local.rank].append(("all_reduce", op))
        a, b = self._both(tensor)
        tensor.copy_(a + b if op == dist.ReduceOp.SUM else torch.maximum(a, b))

    def all_gather(self, out, tensor, group=None):
        self.calls[self.local.rank].append(("all_gather", None))
        out.copy_(torch.cat(self._both(tensor)))

    def run(self, declare):
        """``reduce_metrics(declare(rank))`` on both ranks at once: their results."""
        results = [None, None]

        def rank(r):
            self.local.rank = r
            results[r] = reduce_metrics(declare(r), torch.device("cpu"), 2)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        return results


def test_every_rule_in_one_gather_whatever_order_each_rank_declares(monkeypatch):
    ranks = TwoRanks(monkeypatch)

    def declare(r):
        metrics = [Metric("busy_s", [1.5, 3.0][r], RANKS), Metric("mem_peak_bytes", [5, 7][r], MAX, integer=True),
                   Metric("aux_loss", torch.tensor([2.0, 4.0][r]), MEAN, count=[1, 3][r]),
                   Metric("tokens_dropped", torch.tensor(float(r + 1)), SUM, integer=True)]
        return metrics if r == 0 else metrics[::-1]

    first, second = ranks.run(declare)
    expected = {"busy_s": [1.5, 3.0], "mem_peak_bytes": 7, "aux_loss": 6.0 / 4, "tokens_dropped": 3}
    assert first == second == expected
    assert list(first) == list(expected) and list(second) == list(expected)[::-1]  # in each rank's order
    assert ranks.calls == [[("all_gather", None)]] * 2
    assert isinstance(first["tokens_dropped"], int) and isinstance(first["aux_loss"], float)


def test_without_a_per_rank_value_one_all_reduce_per_op(monkeypatch):
    ranks = TwoRanks(monkeypatch)
    agreed = ranks.run(lambda r: [Metric("loss", torch.tensor([-float("inf"), 2.5][r], dtype=torch.float64), MAX),
                                  Metric("stop", r, MAX)])
    assert agreed == [{"loss": 2.5, "stop": 1}] * 2 and ranks.calls == [[("all_reduce", dist.ReduceOp.MAX)]] * 2

    ranks = TwoRanks(monkeypatch)
    mixed = ranks.run(lambda r: [Metric("z_loss", 1.0 + r, MEAN, count=2), Metric("ratio", [3.0, 2.0][r], MAX),
                                 Metric("mtp_loss", 0.25, SUM)])
    assert mixed == [{"z_loss": 3.0 / 4, "ratio": 3.0, "mtp_loss": 0.5}] * 2
    assert ranks.calls == [[("all_reduce", dist.ReduceOp.SUM), ("all_reduce", dist.ReduceOp.MAX)]] * 2


def test_one_rank_combines_without_collectives_and_bad_declarations_are_refused():
    cpu = torch.device("cpu")
    one = reduce_metrics([Metric("aux_loss", 0.0, MEAN, count=0), Metric("busy_s", 2.0, RANKS),
                          Metric("drops", torch.tensor(3.0), SUM, integer=True)], cpu, 1)
    assert one == {"aux_loss": 0.0, "busy_s": [2.0], "drops": 3}  # nothing counted: a mean of 0
    with pytest.raises(ValueError, match=r"metric names declared twice: \['loss'\]"):
        reduce_metrics([Metric("loss", 1.0), Metric("loss", 2.0, MAX)], cpu, 1)
    with pytest.raises(ValueError, match="reduce='min', expected one of sum, mean, max, ranks"):
        Metric("loss", 1.0, "min")
