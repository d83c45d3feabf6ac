"""The zero-bubble (ZB-H1) action lists: complete and well-ordered, their replay's bubble, their memory
count, and the refusals of ``parallel.pp_schedule``."""

import pytest

from megand.core.pipeline_parallel.actions import (INPUT_GRAD, WEIGHT_GRAD, peak_live_chunks, schedule_actions)
from megand.tools.planner.simulate import simulate

LAYOUTS = [(2, 4), (2, 8), (4, 8), (4, 16), (8, 16)]


@pytest.mark.parametrize("pp, m", LAYOUTS)
def test_every_pass_once_and_in_dependency_order(pp, m):
    for rank in range(pp):
        actions = schedule_actions(pp, None, m, rank, schedule="zb1p")
        keys = [(a.kind, a.microbatch) for a in actions]
        assert sorted(keys) == sorted((k, i) for k in "FIW" for i in range(m)), (rank, keys)
        for i in range(m):
            assert keys.index(("F", i)) < keys.index(("I", i)) < keys.index(("W", i))
        for a in actions:  # the W stays on its rank; the I talks to the neighbours as 1F1B's backward does
            if a.kind == WEIGHT_GRAD:
                assert a.recv_from is None and a.send_to is None
            if a.kind == INPUT_GRAD:
                assert a.recv_from == (None if rank == pp - 1 else rank + 1)
                assert a.send_to == (None if rank == 0 else rank - 1)


@pytest.mark.parametrize("pp, m", LAYOUTS)
def test_replayed_bubble_is_a_third_of_1f1b_at_equal_times(pp, m):
    """F = I = W = 1: 1F1B idles (p-1)(F+B) = 3(p-1) per rank, ZB-H1 (p-1)·F = p-1."""
    ones, twos = [1.0] * pp, [2.0] * pp
    zb = simulate(pp, None, m, ones, twos, schedule="zb1p")
    one_f_one_b = simulate(pp, None, m, ones, twos)
    assert one_f_one_b.makespan == 3 * (m + pp - 1)
    assert zb.makespan == 3 * m + pp - 1
    assert zb.bubble_fraction < one_f_one_b.bubble_fraction


def test_memory_count_holds_the_deferred_weight_gradients():
    """1F1B's forwards awaiting their input gradient, plus up to pp-1 W passes holding their operands."""
    pp, m = 4, 16
    assert [peak_live_chunks(pp, None, m, r) for r in range(pp)] == [4, 3, 2, 1]
    assert [peak_live_chunks(pp, None, m, r, "zb1p") for r in range(pp)] == [7, 6, 5, 4]


def test_refusals_name_the_values():
    with pytest.raises(ValueError, match="vpp=2"):
        schedule_actions(2, 2, 4, 0, schedule="zb1p")
    with pytest.raises(ValueError, match="'zbx'.*1f1b, zb1p, zbv, dualpipev"):
        schedule_actions(2, None, 4, 0, schedule="zbx")
