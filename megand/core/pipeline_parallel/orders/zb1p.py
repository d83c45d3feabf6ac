"""Zero bubble ZB-H1 (``parallel.pp_schedule=zb1p``): 1F1B's forwards, each backward split into I and W."""

from __future__ import annotations

from functools import lru_cache

from megand.core.pipeline_parallel.record import FORWARD, INPUT_GRAD, WEIGHT_GRAD, PipelineSchedule


@lru_cache(maxsize=256)
def zero_bubble_h1_orders(pp: int, m: int) -> tuple:
    """ZB-H1 (one chunk per rank): every rank's order, made by running the pipeline on unit times
    (F = I = W = 1) and letting each rank, whenever it is free, take the first of: an ``I`` whose
    gradient has arrived (the critical path: the previous stage waits for it), an ``F`` whose input has
    arrived while it holds fewer than 1F1B's ``pp - rank`` forwards awaiting their ``I``, then its oldest
    pending ``W``; a rank with more than ``pp - 1`` weight-gradient passes pending runs the oldest first.

    1F1B idles ``(p-1)(F+I+W)`` per rank; here the cool-down's waits between input gradients are filled
    with the deferred ``W`` passes, which leaves ``(p-1)·F`` (a third of 1F1B's bubble at equal
    times). The price: up to ``pp - 1`` micro-batches' weight-gradient operands (each linear layer's
    input and output gradient) held next to 1F1B's activations."""
    orders = [[] for _ in range(pp)]
    forwards, input_grads, weight_grads = [0] * pp, [0] * pp, [0] * pp
    forward_done, input_done = {}, {}  # (rank, micro-batch) -> unit time its result is there
    free_at, now, never = [0] * pp, 0, float("inf")
    while any(w < m for w in weight_grads):
        for r in range(pp):
            if free_at[r] > now:
                continue
            i, f = input_grads[r], forwards[r]
            source = forward_done.get((r, i), never) if r == pp - 1 else input_done.get((r + 1, i), never)
            if input_grads[r] - weight_grads[r] > pp - 1:
                step = WEIGHT_GRAD, weight_grads[r]
            elif i < f and source <= now:
                step = INPUT_GRAD, i
            elif f < m and f - i < pp - r and (r == 0 or forward_done.get((r - 1, f), never) <= now):
                step = FORWARD, f
            elif weight_grads[r] < input_grads[r]:
                step = WEIGHT_GRAD, weight_grads[r]
            else:
                continue
            kind, microbatch = step
            orders[r].append((kind, 0, microbatch))
            free_at[r] = now + 1
            if kind == FORWARD:
                forwards[r] += 1
                forward_done[(r, microbatch)] = now + 1
            elif kind == INPUT_GRAD:
                input_grads[r] += 1
                input_done[(r, microbatch)] = now + 1
            else:
                weight_grads[r] += 1
        now += 1
    return tuple(tuple(order) for order in orders)


def _bubble(pp: int, vpp, m: int, f: float, i: float, w: float) -> tuple:
    """``(p-1)(F+B-2W)`` idle per rank (B = I + W, the whole backward): ``(p-1)·F`` when B = 2W."""
    idle = (pp - 1) * max(f + i - w, 0.0)
    return idle / (m * (f + i + w) + idle), "(p-1)(F+B-2W)/(m(F+B)+(p-1)(F+B-2W))"


SCHEDULE = PipelineSchedule(
    name="zb1p",
    title="zero bubble ZB-H1",
    bubble=_bubble,
    summary="zero bubble ZB-H1: every backward split into its input-gradient pass (I, sent on at once) and "
            "its weight-gradient pass (W, run where the rank would wait)",
    order=lambda pp, vpp, rank, m: list(zero_bubble_h1_orders(pp, m)[rank]),
    chunks=1,
    min_pp=2,
    needs="needs parallel.pp >= 2 and one chunk per rank",
    splits_backward=True,
)
