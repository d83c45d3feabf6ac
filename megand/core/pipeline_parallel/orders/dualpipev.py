"""DualPipeV (``parallel.pp_schedule=dualpipev``): DeepSeek's DualPipe folded into a V, as torchtitan
runs it."""

from __future__ import annotations

from megand.core.pipeline_parallel.orders.zbv import V_NEEDS, v_eval_order
from megand.core.pipeline_parallel.record import (BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, MicrobatchRule,
                                                  PipelineSchedule, v_placement)


def dualpipev_order(pp: int, rank: int, m: int) -> list:
    """DualPipeV on :func:`v_placement`: chunk 0 forwards fill the V, chunk-1 input gradients with
    their weight gradients meet chunk-1 forwards, then the main phase pairs each forward of one chunk
    with a full backward of the other (which a GPU overlaps: one's compute hides the other's
    communication; here they run one after the other), and the cool-down splits the last backwards
    into I and W to fill its waits. Needs ``m >= 2·pp`` micro-batches (:data:`SCHEDULE`'s rule)."""
    order, forwards, backwards, pending = [], [0, 0], [0, 0], []

    def forward(chunk):
        order.append((FORWARD, chunk, forwards[chunk]))
        forwards[chunk] += 1

    def backward(chunk, split):
        order.append((INPUT_GRAD if split else BACKWARD, chunk, backwards[chunk]))
        if split:
            pending.append((chunk, backwards[chunk]))
        backwards[chunk] += 1

    def weight():
        if pending:
            chunk, microbatch = pending.pop(0)
            order.append((WEIGHT_GRAD, chunk, microbatch))

    for _ in range((pp - rank - 1) * 2):
        forward(0)
    for _ in range(rank + 1):
        forward(0)
        forward(1)
    for _ in range(pp - rank - 1):
        backward(1, split=True)
        weight()
        forward(1)
    for _ in range(m - 2 * pp + rank + 1):
        forward(0)
        backward(1, split=False)
        forward(1)
        backward(0, split=False)
    for _ in range(pp - rank - 1):
        backward(1, split=False)
        forward(1)
        backward(0, split=False)
    split = False
    for i in range(rank + 1):
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        backward(1, split)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        backward(0, split)
    for _ in range(pp - rank - 1):
        weight()
        backward(0, split=True)
    while pending:
        weight()
    return order


SCHEDULE = PipelineSchedule(
    name="dualpipev",
    title="DualPipeV",
    summary="DualPipeV (DeepSeek's DualPipe folded into the V, as torchtitan runs it): its main phase pairs a "
            "forward of one chunk with a full backward of the other; needs `m >= 2p`",
    order=lambda pp, vpp, rank, m: dualpipev_order(pp, rank, m),
    placement=v_placement,
    chunks=2,
    min_pp=2,
    needs=V_NEEDS,
    microbatches=lambda pp, vpp: MicrobatchRule(who="parallel.pp_schedule=dualpipev", minimum=2 * pp,
                                                minimum_is=f"2*pp = {2 * pp}"),
    splits_backward=True,
    eval_order=v_eval_order,
)
