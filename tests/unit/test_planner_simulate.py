"""The planner's pipeline replay: megand's own schedule order, and hand-computed timelines."""

import pytest
import torch

from megand.core.pipeline_parallel import schedules
from megand.tools.planner.simulate import rank_operations, simulate


class _NoP2P:
    """Stands in for PipelineP2P: every receive returns a placeholder, nothing is sent."""

    comm_seconds = 0.0

    def exchange(self, items):
        return [torch.zeros(()) for item in items if item[0] == "recv"]

    def __getattr__(self, name):
        if name == "communicate" or name.startswith("send_forward_backward_recv"):
            return lambda *a, **k: (torch.zeros(()), torch.zeros(()))
        return lambda *a, **k: torch.zeros(())


class _Chunk:
    def __init__(self, pre, post):
        self.pre_process, self.post_process = pre, post


class _Topo:
    def __init__(self, pp, rank, vpp):
        self.pp_size, self.pp_rank, self.vpp = pp, rank, vpp
        self.is_first_stage, self.is_last_stage = rank == 0, rank == pp - 1
        self.device = torch.device("cpu")
        self.ranks = {"pp": list(range(pp))}


def _megand_order(monkeypatch, pp, vpp, m, rank):
    """The (kind, virtual stage, micro-batch) sequence megand's schedule runs on ``rank``."""
    order = []

    def forward(self, chunk_id, microbatch, input_tensor):
        order.append(("F", chunk_id * pp + rank, microbatch))
        return torch.tensor(float(microbatch))  # the backward reads which micro-batch it belongs to

    def backward(self, input_tensor, output, output_grad, chunk_id=0):
        order.append(("B", chunk_id * pp + rank, int(output.item())))
        return None

    monkeypatch.setattr(schedules._Steps, "forward", forward)
    monkeypatch.setattr(schedules._Steps, "backward", backward)
    monkeypatch.setattr(schedules, "_p2p", lambda *a: _NoP2P())
    v = vpp or 1
    stages = pp * v
    chunks = [_Chunk(c * pp + rank == 0, c * pp + rank == stages - 1) for c in range(v)]
    topo = _Topo(pp, rank, vpp)
    schedules.get_schedule(topo)(chunks, list(range(m)), None, topo)
    return order


@pytest.mark.parametrize("pp,vpp,m", [(1, None, 3), (2, None, 1), (2, None, 4), (4, None, 6), (2, 2, 2),
                                      (2, 2, 6), (4, 2, 8), (3, 3, 6)])
def test_replay_runs_megands_schedule_order(monkeypatch, pp, vpp, m):
    for rank in range(pp):
        assert rank_operations(pp, vpp, m, rank) == _megand_order(monkeypatch, pp, vpp, m, rank)


def test_1f1b_timeline_by_hand():
    # pp=2, m=2, f=1, b=2: rank 0 F0 [0,1] F1 [1,2] B0 [4,6] B1 [7,9]; rank 1 F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7]
    t = simulate(2, None, 2, [1, 1], [2, 2])
    assert t.ops[("B", 0, 0)] == (4, 6) and t.ops[("F", 1, 1)] == (4, 5) and t.ops[("B", 0, 1)] == (7, 9)
    assert t.makespan == 9 == (2 + 2 - 1) * 3
    assert t.bubble_fraction == pytest.approx(1 / 3)  # (p-1)/(m+p-1)
    assert t.last_backward == [2, 2]  # gradients are final only during the last micro-batch's backward


def test_uneven_stages_by_hand():
    # stage 1 twice as slow (f=[1,2], b=[2,4]); rank 1: F0 [1,3] B0 [3,7] F1 [7,9] B1 [9,13];
    # rank 0: F0 [0,1] F1 [1,2] B0 [7,9] B1 [13,15]
    t = simulate(2, None, 2, [1, 2], [2, 4])
    assert t.ops[("F", 1, 1)] == (7, 9) and t.ops[("B", 0, 0)] == (7, 9) and t.ops[("B", 0, 1)] == (13, 15)
    assert t.makespan == 15
    assert t.busy == [6, 12]
    assert t.bubble_fraction == pytest.approx(((1 - 6 / 15) + (1 - 12 / 15)) / 2)


def test_interleaved_timeline_by_hand():
    # pp=2, vpp=2, m=2 (m == pp: all forwards first), f=1, b=2 per virtual stage; virtual stages 0, 2 on
    # rank 0 and 1, 3 on rank 1: the last backward B(0, mb 1) runs [13, 15]
    t = simulate(2, 2, 2, [1] * 4, [2] * 4)
    assert t.ops[("F", 2, 0)] == (2, 3) and t.ops[("F", 3, 1)] == (4, 5) and t.ops[("B", 3, 0)] == (5, 7)
    assert t.ops[("B", 1, 0)] == (9, 11) and t.ops[("B", 0, 1)] == (13, 15)
    assert t.makespan == 15
    # rank 0's chunk 1 (virtual stage 2) is final at B(2, 1) [9, 11]: the reduction can hide from 9 to 15
    assert t.last_backward == [15 - 9, 13 - 7]


@pytest.mark.parametrize("pp,vpp,m", [(4, None, 8), (4, 2, 8), (8, 4, 32)])
def test_equal_stages_give_the_textbook_bubble(pp, vpp, m):
    v = vpp or 1
    t = simulate(pp, vpp, m, [1 / v] * (pp * v), [2 / v] * (pp * v))
    assert t.bubble_fraction == pytest.approx((pp - 1) / (v * m + pp - 1))


def test_p2p_delays_the_receiver_not_the_sender():
    t = simulate(2, None, 1, [1, 1], [1, 1], p2p=[0.5])
    assert t.ops[("F", 1, 0)] == (1.5, 2.5)  # arrives 0.5 after the send
    assert t.ops[("B", 0, 0)] == (4.0, 5.0)  # the gradient too: B(1) ends at 3.5, +0.5
