"""ZB-V (``parallel.pp_schedule=zbv``): the zero-bubble paper's V schedule, two chunks per rank."""

from __future__ import annotations

from megand.core.pipeline_parallel.record import (FORWARD, INPUT_GRAD, WEIGHT_GRAD, PipelineSchedule,
                                                  v_placement)

V_NEEDS = "runs two chunks per rank in a V: it needs parallel.pp >= 2 and parallel.vpp=2"


def v_eval_order(pp: int, vpp, rank: int, m: int) -> list:
    """Evaluation on the V: each micro-batch down and back up (chunk 0, then chunk 1)."""
    return [(FORWARD, chunk, i) for i in range(m) for chunk in (0, 1)]


def zbv_order(pp: int, rank: int, m: int) -> list:
    """ZB-V on :func:`v_placement`: chunk 0 forwards fill the V, then chunk 1's forwards join, each
    chunk-1 forward followed by its input and weight gradient; the steady state runs F0 I0 W0 F1 I1 W1;
    the cool-down runs input gradients first and moves the weight gradients into the waits. Built for
    ``max(m, 2·pp - 1)`` micro-batches (its warm-up assumes a full V), the extra ones dropped."""
    n = max(m, 2 * pp - 1)
    order, count = [], {(k, c): 0 for k in (FORWARD, INPUT_GRAD, WEIGHT_GRAD) for c in (0, 1)}

    def emit(kind, chunk):
        order.append((kind, chunk, count[(kind, chunk)]))
        count[(kind, chunk)] += 1

    for _ in range(2 * (pp - rank) - 1):
        emit(FORWARD, 0)
    for _ in range(rank):
        emit(FORWARD, 1)
        emit(FORWARD, 0)
    for _ in range(pp - rank):
        emit(FORWARD, 1)
        emit(INPUT_GRAD, 1)
        emit(WEIGHT_GRAD, 1)
    while count[(FORWARD, 1)] < count[(FORWARD, 0)] or count[(FORWARD, 0)] < n:
        if count[(FORWARD, 0)] < n:
            emit(FORWARD, 0)
        emit(INPUT_GRAD, 0)
        emit(WEIGHT_GRAD, 0)
        emit(FORWARD, 1)
        emit(INPUT_GRAD, 1)
        emit(WEIGHT_GRAD, 1)
    for _ in range(rank):
        emit(INPUT_GRAD, 0)
        emit(INPUT_GRAD, 1)
    for _ in range(pp - rank):
        emit(INPUT_GRAD, 0)
        emit(WEIGHT_GRAD, 0)
    for chunk in (1, 0):
        while count[(WEIGHT_GRAD, chunk)] < count[(INPUT_GRAD, chunk)]:
            emit(WEIGHT_GRAD, chunk)
    return [step for step in order if step[2] < m]


SCHEDULE = PipelineSchedule(
    name="zbv",
    title="zero bubble ZB-V",
    summary="ZB-V on the V placement (`parallel.vpp=2`): chunk 0 of rank r is virtual stage r, chunk 1 is "
            "stage `2p-1-r`, so rank 0 holds the embedding and the loss",
    order=lambda pp, vpp, rank, m: zbv_order(pp, rank, m),
    placement=v_placement,
    chunks=2,
    min_pp=2,
    needs=V_NEEDS,
    splits_backward=True,
    eval_order=v_eval_order,
)
