"""The estimator replays a schedule on at most 2·pp·vpp micro-batches (estimate_memory.py,
layer_microbatches_in_flight): every registered schedule's peak of live chunks per rank is the same at
any larger count its rule runs."""

from megand.core.pipeline_parallel.actions import peak_live_chunks
from megand.core.pipeline_parallel.registry import schedule_names, schedule_record


def test_every_schedule_holds_a_steady_peak_past_two_pp_vpp_microbatches():
    checked = 0
    for name in schedule_names():
        record = schedule_record(name)
        for pp in range(2, 6):
            for vpp in (None, 2, 3):
                if record.layout_error(pp, vpp):
                    continue
                rule, v = record.microbatch_rule(pp, vpp), vpp or 1
                cap = rule.smallest_at_least(2 * pp * v)
                for rank in range(pp):
                    at_cap = peak_live_chunks(pp, vpp, cap, rank, name)
                    more = [m for m in range(cap + 1, 5 * pp * v + 1) if rule.error(m) is None]
                    assert all(peak_live_chunks(pp, vpp, m, rank, name) == at_cap for m in more), (name, pp, vpp, rank)
                    checked += len(more)
    assert checked > 100
