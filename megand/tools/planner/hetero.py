"""Heterogeneous search (H2's HeteroAuto in spirit): stages homogeneous, each on one cluster group.

cp and dp are uniform; each group's stages run one tp, which may differ between groups (stages of
different widths: ``Candidate.stage_widths``, each stage costed and estimated at its own width), so a
stage of group g has tp_g*cp*dp ranks. A depth-first search over the per-group tp, dp and how many
stages each group hosts (groups in order of decreasing device memory: the
early stages hold the most micro-batches in flight under 1F1B; a large group split into several
stages; pp never above the layer count) chooses, for each assignment, the per-stage layer counts that
minimise the slowest stage's time under each stage's memory (:func:`balanced_layout`, a bisection on
the stage time, exact for that objective), emitted as ``parallel.pipeline_layout``. With per-stage
recompute (``train.recompute_layers`` not pinned) each stage may also recompute only some of its layers:
:func:`balanced_recomputing_layout` balances the layers knowing that a stage with spare memory stores
its activations and one short of memory recomputes the fewest layers that fit (H2 tunes each chip
type's stages to its resources the same way), then each stage's exact fewest recomputed layers are
found on the estimator (search.Planner.fewest_recomputed). Candidates are then timed in order of their
lower bound, as the homogeneous ones (search.Planner.best); before any split, shapes are weighed in
order of :func:`split_bound` and those that cannot enter the top plans are never split.

Every stage runs the same pipeline schedule: 1F1B or zb1p with one chunk per rank, or a V (zbv,
dualpipev: vpp=2, chunk 0 of rank r is virtual stage r and chunk 1 is stage 2·pp - 1 - r). The layer
split is balanced per rank (its time and memory grow with the layers it holds, whichever chunks they
sit in); a V rank's layers are then split over its two chunks (:func:`chunk_layout`), and each rank's
recomputed layers over the chunks it holds. Interleaved 1F1B is not searched here.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math

from megand.core.pipeline_parallel.registry import DEFAULT_SCHEDULE, schedule_record
from megand.tools.planner.cost import rank_virtual_stages
from megand.tools.planner.layout import Candidate
from megand.tools.planner.search import RECOMPUTE, spread


def plan_heterogeneous(planner, top: int = 5, ceiling: float = math.inf) -> list:
    """The best heterogeneous plans of ``planner`` (a search.Planner) on its cluster. Shapes (a layout and
    its stages' groups, before the sharding, overlap and schedule choices, the layer split and memory) are
    weighed in order of :func:`split_bound`, a bound for all of their candidates; only the shapes that can
    still enter the top ``top`` are expanded, their candidates weighed again at their own
    :func:`recompute_bound` (when their turn comes: most never need it), and only those that can still enter
    are split (the estimator: most of the time) and timed. ``ceiling``: a step no plan of interest reaches
    (the caller's top so far: nothing at or above it is split)."""
    queue = []  # (bound, order, stage groups, expand() of a shape or (candidate, bound refined?)), least first
    for c, stage_groups, expand in hetero_shapes(planner):
        queue.append((split_bound(planner, c, stage_groups), len(queue), stage_groups, expand))
        if planner.out_of_time():
            break
    heapq.heapify(queue)
    order = len(queue)
    plans = []
    while queue:
        bound, _, stage_groups, item = heapq.heappop(queue)
        if bound >= ceiling or (len(plans) >= top and bound >= plans[-1].prediction.step_time_s):
            break
        if plans and planner.out_of_time():
            break
        if callable(item):  # a shape: its candidates wait in line at its bound until their turn
            for c in item():
                heapq.heappush(queue, (bound, order, stage_groups, (c, False)))
                order += 1
            continue
        c, refined = item
        if not refined:  # its own bound, the recomputation its memory forces counted: back in line if higher
            own, refined = _recompute_bound(planner, c, stage_groups, above=bound)
            if own > bound:
                heapq.heappush(queue, (own, order, stage_groups, (c, refined)))
                order += 1
                continue
        plans = planner.best(_split(planner, c, stage_groups), top, plans)
    return plans


def group_widths(planner, groups):
    """Per group, the tp of its stages (within its nodes): every combination, the equal ones first."""
    domains = [planner.tp_domain(g.devices_per_node) for g in groups]
    return sorted(itertools.product(*domains), key=lambda w: len(set(w)) > 1)


def hetero_shapes(planner):
    """``(candidate, stage groups, expand)`` of every pipeline over at least two groups, before the layer
    split and memory: per group a tp (:func:`group_widths`; stages of different widths where they differ),
    cp and dp uniform, the stages each group hosts (:func:`_assignments`), the micro-batch size, sequence
    parallelism, cp_comm and the schedules' placement (what :func:`split_bound` sees); ``expand()`` gives
    its candidates, one per sharding, overlap and schedule choice."""
    groups = sorted(planner.cluster.groups, key=lambda g: -g.memory_gib)  # larger memory: earlier stages
    L = planner.shape.layers
    sp_pinned = planner.pinned.get("parallel.sequence_parallel")
    for tps in group_widths(planner, groups):
        for cp in planner._dom("parallel.cp", sorted(set.intersection(*(set(planner.cp_domain(t)) for t in tps)))):
            max_dp = max(g.devices // (t * cp) for g, t in zip(groups, tps))
            dps = [d for d in range(1, max_dp + 1) if planner.gbs % d == 0]
            for dp in planner._dom("parallel.dp", dps):
                caps = [_stages_on(g, t * cp * dp) for g, t in zip(groups, tps)]
                for counts in _assignments(caps, L):
                    stage_groups = [g for g, n in zip(groups, counts) for _ in range(n)]
                    pp = len(stage_groups)
                    if pp < 2 or len({g.name for g in stage_groups}) < 2:
                        continue  # one group only: the homogeneous search covers it
                    if "parallel.pp" in planner.pinned and planner.pinned["parallel.pp"] != pp:
                        continue
                    ranks_tp = [t for t, n in zip(tps, counts) for _ in range(n)]
                    mixed = len(set(ranks_tp)) > 1
                    widths = tuple((t, t > 1 if sp_pinned is None else bool(sp_pinned)) for t in ranks_tp) \
                        if mixed else None
                    dpn = min(g.devices_per_node for g in stage_groups)
                    by_shape = {}  # (sp, cp_comm, the schedule's placement) -> [(opts, vpp, schedule)]
                    for opts in planner.options(ranks_tp[0], cp, dp, pp, dpn):
                        if mixed:  # each stage's own sequence parallelism; shard groups of one size
                            if opts["dp_shard"] is not None:
                                continue
                            opts = {**opts, "sequence_parallel": widths[0][1]}
                        for vpp, schedule in hetero_schedules(planner, pp):
                            key = (opts["sequence_parallel"], opts["cp_comm"], _placement_key(pp, vpp, schedule))
                            by_shape.setdefault(key, []).append((opts, vpp, schedule))
                    for mbs in planner.microbatch_domain(dp):
                        for members in by_shape.values():
                            def make(opts, vpp, schedule, mbs=mbs, widths=widths, tp=ranks_tp[0], pp=pp, cp=cp, dp=dp):
                                c = Candidate.or_none(tp=tp, pp=pp, vpp=vpp, cp=cp, dp=dp, micro_batch_size=mbs,
                                                      pp_schedule=schedule, **opts, **planner._base())
                                if c is not None and widths is not None:
                                    c = _with_widths(c, widths)
                                return c if c is not None and planner._quick_valid(c) else None

                            first = next(filter(None, (make(*m) for m in members)), None)
                            if first is None:
                                continue
                            yield first, stage_groups, (lambda members=members, make=make:
                                                        [c for c in map(lambda m: make(*m), members) if c is not None])


def _placement_key(pp: int, vpp, schedule: str) -> tuple:
    """Where each rank's virtual stages sit under ``schedule``: all of the schedule a stage's times depend on."""
    placement = schedule_record(schedule).placement(pp, vpp)
    return tuple(tuple(placement.stages_of(r)) for r in range(pp))


def _with_widths(c: Candidate, widths):
    """``c`` with its stages at ``widths`` (None where some width breaks a rule of the layout)."""
    from megand.core.parallel_layout import LayoutError

    try:
        mixed = c.with_(stage_widths=widths)
        mixed.widths()
    except LayoutError:
        return None
    return mixed


def split_bound(planner, c: Candidate, stage_groups) -> float:
    """A lower bound on the step of every layer split of ``c`` on ``stage_groups`` (and every sharding,
    recompute and overlap choice): the busiest rank's compute at its best, the layers spread continuously
    so that every rank finishes together (each rank's time per micro-batch is ``fixed + slope * layers``,
    exact at ZeRO-0 without recompute, each of which only adds). Memoised over the keys it ignores."""
    if c.fp8:  # FP8 layers cost less than the others: per-rank time not linear in the layers
        return 0.0
    base = c.with_(sharding="none", dp_shard=None, recompute="none", recompute_layers=None,
                   overlap_grad_reduce=False, overlap_param_gather=False, reshard_after_forward=False)
    key = ("split", base.with_(pp_schedule=DEFAULT_SCHEDULE if c.vpp is None else c.pp_schedule),
           tuple(g.name for g in stage_groups))
    if key not in planner._bounds:
        pp, L = c.pp, planner.shape.layers
        t1 = rank_step(planner.times(base.with_(pipeline_layout=chunk_layout(c, [1] * pp)), stage_groups), c)
        t2 = rank_step(planner.times(base.with_(pipeline_layout=chunk_layout(c, [2] * pp)), stage_groups), c)
        slope = [max(b - a, 1e-15) for a, b in zip(t1, t2)]
        fixed = [a - k for a, k in zip(t1, slope)]
        least = _least_layers(c)
        lo = max(f + k * least for f, k in zip(fixed, slope))  # every rank holds at least a layer per chunk
        m = c.parallel.microbatches(planner.gbs, c.micro_batch_size)
        planner._bounds[key] = m * max(lo, _level(fixed, slope, L)) * (1 - 1e-9)
    return planner._bounds[key]


def _level(fixed, slope, L: float) -> float:
    """The time T at which ranks of time ``fixed + slope * x`` for x layers hold ``L`` layers together, each
    ``max(0, (T - fixed) / slope)`` (continuous): water-filling over the ranks in order of ``fixed``."""
    ranks = sorted(zip(fixed, slope))
    total_f = total_inv = 0.0
    level = ranks[0][0]
    for i, (f, k) in enumerate(ranks):
        total_f, total_inv = total_f + f / k, total_inv + 1 / k
        level = (L + total_f) / total_inv
        if i + 1 == len(ranks) or level <= ranks[i + 1][0]:  # the next rank would start above this level
            break
    return level


def recompute_bound(planner, c: Candidate, stage_groups) -> float:
    """A lower bound on the step of every layer split of ``c`` (its own sharding, schedule and memory), the
    recomputation its memory forces counted: per rank and layer count n, the fastest of storing every
    activation (where that fits) and of each recompute mode on the fewest layers that fit, each rank's time
    per micro-batch ``fixed + slope·n + extra·k`` at ZeRO-0 (:func:`split_bound`'s, plus ``extra`` per
    recomputed layer: both exact), its memory linear in n and k from the estimator at the points
    :func:`balanced_recomputing_layout` reads (cached: the split asks for the same ones); then the least
    slowest rank over every split of the layers (each rank's possible layer counts relaxed to an interval).
    0 where the split is pinned or the times are not linear (FP8)."""
    return _recompute_bound(planner, c, stage_groups)[0]


def _recompute_bound(planner, c: Candidate, stage_groups, above: float = math.inf):
    """(:func:`recompute_bound`, True), or where the whole numbers of layers per rank alone put the bound
    above ``above`` (memory aside: no estimator question asked), (that bound, False)."""
    if c.fp8 or "parallel.pipeline_layout" in planner.pinned or not planner.per_stage_recompute:
        return 0.0, True
    L, pp, least = planner.shape.layers, c.pp, _least_layers(c)
    if pp * least > L:
        return 0.0, True
    m = c.parallel.microbatches(planner.gbs, c.micro_batch_size)
    one, two = chunk_layout(c, [1] * pp), chunk_layout(c, [2] * pp)
    zero = c.with_(sharding="none", dp_shard=None, recompute="none", recompute_layers=None,
                   overlap_grad_reduce=False, overlap_param_gather=False, reshard_after_forward=False)
    t1 = rank_step(planner.times(zero.with_(pipeline_layout=one), stage_groups), c)
    t2 = rank_step(planner.times(zero.with_(pipeline_layout=two), stage_groups), c)
    counts = range(least, L + 1)
    key = ("free", zero, tuple(g.name for g in stage_groups))  # alike for every sharding and schedule placed so
    if key not in planner._bounds:  # the least slowest rank, memory aside
        planner._bounds[key] = _least_slowest([[(n, t1[r] + (t2[r] - t1[r]) * (n - 1)) for n in counts]
                                               for r in range(pp)], L)
    free = planner._bounds[key]
    if m * free * (1 - 1e-9) > above:
        return m * free * (1 - 1e-9), False
    stored = c.with_(recompute="none", recompute_layers=None)
    m1 = planner.memory(stored.with_(pipeline_layout=one), microbatches=m)
    m2 = planner.memory(stored.with_(pipeline_layout=two), microbatches=m)
    lines = []  # per rank: (fixed, slope) seconds per micro-batch, (base, per_layer) GiB, its device's GiB
    for r, g in enumerate(stage_groups):
        slope, per_layer = t2[r] - t1[r], m2[r] - m1[r]
        lines.append((t1[r] - slope, slope, m1[r] - per_layer, per_layer, g.memory_gib))
    # every rank can hold its layer counts within ``free`` storing all activations: the memory forces nothing
    # at the best split, and no recomputation can do better (a count misjudged at the edge only loosens this)
    within = [min(L, math.floor((free - f) / k + 1e-9) if k > 0 else L,
                  math.floor((cap - base + 1e-9) / per) if per > 0 else L) for f, k, base, per, cap in lines]
    if min(within) >= least and sum(within) >= L:
        return m * free * (1 - 1e-9), True
    modes = []  # per recompute mode: per rank (extra seconds, memory saved per recomputed layer, working set)
    for mode in planner._dom("train.recompute", RECOMPUTE):
        if mode == "none":
            continue
        tr = rank_step(planner.times(zero.with_(recompute=mode, pipeline_layout=one), stage_groups), c)
        recomputing = c.with_(recompute=mode, pipeline_layout=two)
        m21 = planner.memory(recomputing.with_(recompute_layers=chunk_recompute(c, two, [1] * pp)), microbatches=m)
        m22 = planner.memory(recomputing.with_(recompute_layers=None), microbatches=m)
        modes.append([(tr[r] - t1[r], m21[r] - m22[r], m21[r] - m2[r] + (m21[r] - m22[r])) for r in range(pp)])
    table = []  # per rank: (n, fastest time per micro-batch) for the n that can fit
    for r, (fixed, slope, base, per_layer, cap) in enumerate(lines):
        times = []
        own = [per_rank[r] for per_rank in modes if per_rank[r][1] > 0]  # (extra, saved, working)
        for n in counts:
            need = base + per_layer * n - cap
            if need <= 1e-9:
                times.append((n, fixed + slope * n))
                continue
            # the fewest recomputed layers that fit, k <= n, and their cost, in the cheapest mode
            ks = [(extra, max(1, math.ceil((need + working) / saved - 1e-9))) for extra, saved, working in own]
            best = min((extra * k for extra, k in ks if k <= n), default=None)
            if best is not None:
                times.append((n, fixed + slope * n + best))
        table.append(times)
    return m * _least_slowest(table, L) * (1 - 1e-9), True


def _least_slowest(table, L: int) -> float:
    """The least time ``T`` such that every rank has a layer count of time at most ``T`` (``table``: per rank,
    ``(layers, time)`` in increasing layers) and the layers can sum to ``L`` with each rank's count between
    its fewest and most within ``T`` (a relaxation: so a lower bound); inf if none."""
    if any(not times for times in table):
        return math.inf

    def feasible(limit):
        lo = hi = 0
        for times in table:
            ns = [n for n, t in times if t <= limit]
            if not ns:
                return False
            lo, hi = lo + ns[0], hi + ns[-1]
        return lo <= L <= hi

    limits = sorted({t for times in table for _, t in times})
    i = bisect.bisect_left(range(len(limits)), True, key=lambda j: feasible(limits[j]))
    return limits[i] if i < len(limits) else math.inf


def hetero_schedules(planner, pp: int) -> list:
    """``[(vpp, schedule), ...]`` a heterogeneous pipeline of ``pp`` stages tries: one chunk per rank
    (1f1b, zb1p), and with two the schedules whose record fixes two chunks per rank (the V ones; pruned
    where a rank could not hold a layer per chunk). Interleaving (a free vpp) is not searched here."""
    vpps = planner._dom("parallel.vpp", [None, 2] if 2 * pp <= planner.shape.layers else [None])
    return [(vpp, s) for vpp in vpps for s in planner.schedules(pp, vpp)
            if vpp is None or schedule_record(s).chunks == vpp]


def chunk_layout(c: Candidate, per_rank) -> tuple:
    """Layers per virtual stage from layers per rank: the same for one chunk per rank; a V rank's layers
    split over its two chunks (the first chunk taking the odd one)."""
    ranks = rank_virtual_stages(c)
    if len(ranks[0]) == 1:
        return tuple(per_rank)
    out = [0] * (len(ranks[0]) * c.pp)
    for r, stages in enumerate(ranks):
        for s, n in zip(stages, spread(per_rank[r], [per_rank[r]] * len(stages))):
            out[s] = n
    return tuple(out)


def chunk_recompute(c: Candidate, layout, per_rank) -> tuple:
    """Recomputed layers per virtual stage from per-rank counts (spread over each rank's chunks)."""
    ranks = rank_virtual_stages(c)
    if len(ranks[0]) == 1:
        return tuple(per_rank)
    out = [0] * len(layout)
    for r, stages in enumerate(ranks):
        for s, k in zip(stages, spread(per_rank[r], [layout[j] for j in stages])):
            out[s] = k
    return tuple(out)


def rank_step(times, c: Candidate) -> list:
    """Per rank: forward + backward seconds of one micro-batch over the chunks it holds."""
    return [sum(times.forward[s] + times.backward[s] for s in stages) for stages in rank_virtual_stages(c)]


def _stages_on(group, size: int) -> int:
    """Stages of ``size`` ranks a group can host on whole nodes (a stage within a node, or whole nodes)."""
    dpn = group.devices_per_node
    if size % dpn and dpn % size:
        return 0
    return group.devices // size


def _assignments(caps, L: int, prefix=()):
    """Depth-first: stages per group (each up to its capacity, pp <= layers)."""
    if len(prefix) == len(caps):
        if sum(prefix) >= 1:
            yield prefix
        return
    used = sum(prefix)
    for n in range(min(caps[len(prefix)], L - used), -1, -1):
        yield from _assignments(caps, L, prefix + (n,))


def _split(planner, c: Candidate, stage_groups) -> list:
    """The layer splits balancing stage time under memory: with the least recompute applied to every layer
    that fits and (:attr:`search.Planner.per_stage_recompute`) with each recompute mode on the fewest
    layers per stage; as [(lower bound, candidate, groups, times)] (empty if nothing fits)."""
    pinned = planner.pinned.get("parallel.pipeline_layout")
    pinned_layers = planner.pinned.get("train.recompute_layers")
    trials = []
    for recompute in planner._dom("train.recompute", RECOMPUTE):
        if recompute == "none" and pinned_layers is not None:
            continue
        base = c.with_(recompute=recompute, recompute_layers=tuple(pinned_layers) if pinned_layers is not None else None)
        if not trials:  # the least recompute that fits on every layer
            layout = tuple(pinned) if pinned else balanced_layout(planner, base, stage_groups)
            if layout is not None and len(layout) == c.pp * (c.vpp or 1) and planner.fits(base.with_(pipeline_layout=layout),
                                                                             stage_groups):
                trials.append(base.with_(pipeline_layout=layout))
                if recompute == "none" or not planner.per_stage_recompute:
                    break
        if recompute != "none" and planner.per_stage_recompute:
            layout = tuple(pinned) if pinned else balanced_recomputing_layout(planner, base, stage_groups)
            if layout is not None and len(layout) == c.pp * (c.vpp or 1):
                full = base.with_(pipeline_layout=layout)
                if planner.fits(full, stage_groups):
                    fewer = planner.fewest_recomputed(full, stage_groups)
                    if fewer not in trials:
                        trials.append(fewer)
    entries = []
    for trial in trials:
        times = planner.times(trial, stage_groups)
        entries.append((times.lower_bound(c.pp), trial, list(stage_groups), times))
    return entries


def _least_layers(c: Candidate) -> int:
    """The fewest layers a rank holds: one per chunk it holds (a chunk of no layers is allowed by
    ``parallel.pipeline_layout`` but only makes a V's turn longer)."""
    return len(rank_virtual_stages(c)[0])


def balanced_layout(planner, c: Candidate, stage_groups):
    """Layers per stage minimising the slowest stage's time (forward + backward of one micro-batch)
    subject to each stage's memory; None when the layers cannot fit."""
    L, pp, least = planner.shape.layers, c.pp, _least_layers(c)
    if pp * least > L:
        return None
    m = c.parallel.microbatches(planner.gbs, c.micro_batch_size)
    # per-rank time and memory as a + b * layers, from the model at two layer counts
    one = c.with_(pipeline_layout=chunk_layout(c, [1] * pp))
    two = c.with_(pipeline_layout=chunk_layout(c, [2] * pp))
    t1 = rank_step(planner.times(one, stage_groups), c)
    t2 = rank_step(planner.times(two, stage_groups), c)
    m1, m2 = planner.memory(one, microbatches=m), planner.memory(two, microbatches=m)  # cached
    slope = [t2[r] - t1[r] for r in range(pp)]
    fixed = [t1[r] - slope[r] for r in range(pp)]
    caps = []
    for r, g in enumerate(stage_groups):
        per_layer = m2[r] - m1[r]
        room = g.memory_gib - (m1[r] - per_layer)
        caps.append(int(math.floor(room / per_layer + 1e-9)) if per_layer > 0 else L)
    if sum(min(cap, L) for cap in caps) < L or min(caps) < least:
        return None

    def counts(limit):
        return [max(0, min(caps[r], int(math.floor((limit - fixed[r]) / max(slope[r], 1e-15) + 1e-9)))) for r in range(pp)]

    lo, hi = 0.0, max(fixed[r] + slope[r] * L for r in range(pp))
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(counts(mid)) >= L and min(counts(mid)) >= least:
            hi = mid
        else:
            lo = mid
    n = counts(hi)
    while sum(n) > L:  # give back layers from the stages that would be slowest
        r = max((r for r in range(pp) if n[r] > least), key=lambda r: fixed[r] + slope[r] * n[r])
        n[r] -= 1
    return chunk_layout(c, n) if sum(n) == L and min(n) >= least else None


def balanced_recomputing_layout(planner, c: Candidate, stage_groups):
    """Layers per stage minimising the slowest stage's time when each stage recomputes (with ``c.recompute``)
    only the fewest of its layers that fit its memory; None when the layers cannot fit.

    Per stage, time and memory are linear in its layers n and recomputed layers k (from the cost model
    and the estimator at a few points): t = fixed + slope·n + extra·k, memory = base + per_layer·n, less
    ``saved`` per recomputed layer plus the recomputation's working set once k > 0. Its fastest fitting
    time is then nondecreasing in n, and a bisection on the slowest stage's time gives the split."""
    L, pp, least = planner.shape.layers, c.pp, _least_layers(c)
    if pp * least > L:
        return None
    m = c.parallel.microbatches(planner.gbs, c.micro_batch_size)
    stored = c.with_(recompute="none", recompute_layers=None)
    one, two = chunk_layout(c, [1] * pp), chunk_layout(c, [2] * pp)
    t1 = rank_step(planner.times(stored.with_(pipeline_layout=one), stage_groups), c)
    t2 = rank_step(planner.times(stored.with_(pipeline_layout=two), stage_groups), c)
    tr = rank_step(planner.times(c.with_(pipeline_layout=one, recompute_layers=None), stage_groups), c)
    m1 = planner.memory(stored.with_(pipeline_layout=one), microbatches=m)
    m2 = planner.memory(stored.with_(pipeline_layout=two), microbatches=m)
    m21 = planner.memory(c.with_(pipeline_layout=two, recompute_layers=chunk_recompute(c, two, [1] * pp)),
                        microbatches=m)
    m22 = planner.memory(c.with_(pipeline_layout=two, recompute_layers=None), microbatches=m)
    table = []
    for r, g in enumerate(stage_groups):
        slope = t2[r] - t1[r]
        fixed = t1[r] - slope
        extra = tr[r] - t1[r]
        per_layer, saved = m2[r] - m1[r], m21[r] - m22[r]
        base, working = m1[r] - per_layer, m21[r] - (m2[r] - saved)
        times = []
        for n in range(L + 1):
            need = base + per_layer * n - g.memory_gib
            if need <= 1e-9:
                k = 0
            elif saved <= 0:
                k = n + 1
            else:
                k = max(1, math.ceil((need + working) / saved - 1e-9))
            times.append(fixed + slope * n + extra * k if k <= n else math.inf)
        for n in range(1, L + 1):  # the fastest fitting time is nondecreasing in n (kept so for bisect)
            times[n] = max(times[n], times[n - 1])
        table.append(times)

    def counts(limit):
        return [bisect.bisect_right(table[r], limit) - 1 for r in range(pp)]

    finite = [t for times in table for t in times if t < math.inf]
    if not finite:
        return None
    lo, hi = 0.0, max(finite)
    if sum(counts(hi)) < L or min(counts(hi)) < least:
        return None
    for _ in range(60):
        mid = (lo + hi) / 2
        n = counts(mid)
        if sum(n) >= L and min(n) >= least:
            hi = mid
        else:
            lo = mid
    n = counts(hi)
    while sum(n) > L:  # give back layers from the stages that would be slowest
        r = max((r for r in range(pp) if n[r] > least), key=lambda r: table[r][n[r]])
        n[r] -= 1
    return chunk_layout(c, n) if sum(n) == L and min(n) >= least else None


def speedup(planner) -> dict:
    """The heterogeneous speed-up ``planner`` predicts: its best heterogeneous plan's throughput over the sum
    of each group's best homogeneous throughput (each group alone on the same model and batch)."""
    homogeneous = {g.name: planner.plan_homogeneous(g, 1) for g in planner.cluster.groups}
    best = {name: plans[0].prediction.tokens_per_s if plans else 0.0 for name, plans in homogeneous.items()}
    hetero = planner.plan_heterogeneous(1)
    plan = hetero[0] if hetero else None
    total = sum(best.values())
    return {"homogeneous_tokens_per_s": best, "homogeneous_plans": {k: v[0] if v else None for k, v in homogeneous.items()},
            "plan": plan, "tokens_per_s": plan.prediction.tokens_per_s if plan else 0.0,
            "ratio": plan.prediction.tokens_per_s / total if plan and total else None}
