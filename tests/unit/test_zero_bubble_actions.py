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


V_LAYOUTS = [(2, 4), (2, 8), (4, 8), (4, 16)]


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
@pytest.mark.parametrize("pp, m", V_LAYOUTS)
def test_v_schedules_run_every_pass_once_on_the_v(schedule, pp, m):
    """Every chunk runs each micro-batch's forward and backward (full, or I then W) once, in dependency
    order; chunk 0 of rank r is stage r, chunk 1 stage 2pp-1-r; the last rank hands its chunk 0's output
    to its own chunk 1, and the loss (the last stage) is on rank 0."""
    for rank in range(pp):
        actions = schedule_actions(pp, 2, m, rank, schedule=schedule)
        for chunk, stage in ((0, rank), (1, 2 * pp - 1 - rank)):
            mine = [a for a in actions if a.chunk == chunk]
            assert {a.stage for a in mine} == {stage}
            for i in range(m):
                kinds = [a.kind for a in mine if a.microbatch == i]
                assert kinds in (["F", "B"], ["F", "I", "W"]), (rank, chunk, i, kinds)
        turn = [a for a in actions if a.send_to == rank or a.recv_from == rank]
        assert all(rank == pp - 1 for _ in turn) and (rank != pp - 1 or len(turn) == 4 * m)
        assert any(a.stage == 2 * pp - 1 for a in actions) == (rank == 0)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
@pytest.mark.parametrize("pp, m", V_LAYOUTS)
def test_each_channel_is_received_in_the_order_it_is_sent(schedule, pp, m):
    """Per peer and kind (activation or gradient) the receiver takes the sender's messages in its send
    order (gloo matches by tag); across kinds the orders may differ, which the p2p handles by the
    sender's order where the backend ignores tags."""
    actions = {r: schedule_actions(pp, 2, m, r, schedule=schedule) for r in range(pp)}
    for a in range(pp):
        for b in range(pp):
            if a == b:
                continue
            for kind in ("act", "grad"):
                sent = [(x.stage, x.microbatch) for x in actions[a]
                        if x.send_to == b and (x.kind == "F") == (kind == "act")]
                received = [(x.stage - 1 if x.kind == "F" else x.stage + 1, x.microbatch) for x in actions[b]
                            if x.recv_from == a and (x.kind == "F") == (kind == "act")]
                assert sent == received, (a, b, kind)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_replay_idles_less_than_zb1p_and_1f1b(schedule):
    pp, m = 4, 16
    ones, twos = [1.0] * pp, [2.0] * pp
    v = simulate(pp, 2, m, [0.5] * 2 * pp, [1.0] * 2 * pp, schedule=schedule)
    assert v.bubble_fraction < simulate(pp, None, m, ones, twos, schedule="zb1p").bubble_fraction
    assert v.bubble_fraction < simulate(pp, None, m, ones, twos).bubble_fraction / 4
    assert [peak_live_chunks(pp, 2, m, r, schedule) for r in range(pp)] == [2 * pp + (schedule == "dualpipev")] * pp


def test_v_refusals_name_the_values():
    with pytest.raises(ValueError, match="vpp=2.*pp=2, vpp=None"):
        schedule_actions(2, None, 4, 0, schedule="zbv")
    with pytest.raises(ValueError, match="at least 2\\*pp = 8 micro-batches.*got 4"):
        schedule_actions(4, 2, 4, 0, schedule="dualpipev")


def test_v_schedules_are_accepted_on_nccl(monkeypatch):
    """Every pipeline message kind and direction has its own group (megand/core/pipeline_parallel/p2p.py),
    so NCCL's matching by order runs the V schedules as gloo does: a GPU run may ask for them (it was
    refused at configuration while one group carried everything)."""
    import torch

    from megand.training.config import compose, validate

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    for schedule in ("zbv", "dualpipev"):
        validate(compose(["+experiment=tiny_llama", "parallel.pp=2", "parallel.vpp=2", f"parallel.pp_schedule={schedule}"]), 2)
