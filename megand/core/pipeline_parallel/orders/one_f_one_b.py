"""1F1B (``parallel.pp_schedule=1f1b``, the default), interleaved over the chunks when ``parallel.vpp``
is set, and fill-drain (GPipe, kept for comparison: not a choice of the config)."""

from __future__ import annotations

from typing import Optional

from megand.core.pipeline_parallel.record import BACKWARD, FORWARD, MicrobatchRule, PipelineSchedule


def no_pipelining_order(m: int) -> list:
    """pp = 1 (gradient accumulation): forward then backward of each micro-batch in turn."""
    return [(kind, 0, i) for i in range(m) for kind in (FORWARD, BACKWARD)]


def one_f_one_b_order(pp: int, rank: int, m: int, num_warmup: Optional[int] = None) -> list:
    """1F1B: ``pp - rank - 1`` warm-up forwards, then one forward and one backward, then the remaining
    backwards; stage 0 holds at most pp micro-batches. ``num_warmup=m`` is fill-drain (GPipe)."""
    warmup = min(pp - rank - 1, m) if num_warmup is None else num_warmup
    order = [(FORWARD, 0, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [(FORWARD, 0, warmup + i), (BACKWARD, 0, i)]
    return order + [(BACKWARD, 0, i) for i in range(m - warmup, m)]


def interleaved_order(pp: int, vpp: int, rank: int, m: int) -> list:
    """Megatron's interleaved 1F1B over ``vpp`` chunks per rank (m a multiple of pp). Step k of the
    rank's forwards (and of its backwards) works on micro-batch ``(k // (pp·vpp))·pp + k % pp`` of chunk
    ``(k // pp) % vpp`` (backwards: the chunks reversed), i.e. groups of pp micro-batches run through
    chunk 0, then chunk 1, ...; ``2·(pp - rank - 1) + (vpp - 1)·pp`` warm-up forwards (all of them when
    m == pp)."""
    total = m * vpp
    warmup = total if m == pp else min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)

    def step(k, kind):
        chunk = (k % (pp * vpp)) // pp
        return kind, chunk if kind == FORWARD else vpp - 1 - chunk, (k // (pp * vpp)) * pp + k % pp

    order = [step(k, FORWARD) for k in range(warmup)]
    for k in range(total - warmup):
        order += [step(warmup + k, FORWARD), step(k, BACKWARD)]
    return order + [step(k, BACKWARD) for k in range(total - warmup, total)]


def _order(pp: int, vpp: Optional[int], rank: int, m: int) -> list:
    if (vpp or 1) > 1:
        return interleaved_order(pp, vpp, rank, m)
    return one_f_one_b_order(pp, rank, m)


def _microbatches(pp: int, vpp: Optional[int]) -> MicrobatchRule:
    """Interleaving runs groups of pp micro-batches through each chunk: a multiple of pp."""
    if vpp is None:
        return MicrobatchRule(who="parallel.pp_schedule=1f1b")
    return MicrobatchRule(who="interleaved pipelining", multiple=pp, multiple_of="pp")


def _bubble(pp: int, vpp: Optional[int], m: int, f: float, i: float, w: float) -> tuple:
    """1F1B idles ``(p-1)/(m+p-1)`` of the step, interleaved over v chunks ``(p-1)/(v·m+p-1)``."""
    if (vpp or 1) > 1:
        return (pp - 1) / (vpp * m + pp - 1), "(p-1)/(v·m+p-1)"
    return (pp - 1) / (m + pp - 1), "(p-1)/(m+p-1)"


SCHEDULE = PipelineSchedule(
    name="1f1b",
    title="1F1B",
    summary="1F1B; interleaved 1F1B when `parallel.vpp` is set",
    order=_order,
    microbatches=_microbatches,
    bubble=_bubble,
)

FILL_DRAIN = PipelineSchedule(
    name="fill_drain",
    title="fill-drain (GPipe)",
    summary="GPipe: every forward, then every backward (for comparison; not a config choice)",
    order=lambda pp, vpp, rank, m: one_f_one_b_order(pp, rank, m, num_warmup=m),
    chunks=1,
    needs="runs one chunk per rank",
)
