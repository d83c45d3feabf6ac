"""Heterogeneous search (H2's HeteroAuto in spirit): stages homogeneous, each on one cluster group.

tp, cp and dp are uniform (megand's grid), so every stage has S = tp*cp*dp ranks. A depth-first search
over dp and over how many stages each group hosts (groups in order of decreasing device memory: the
early stages hold the most micro-batches in flight under 1F1B; a large group split into several
stages; pp never above the layer count) chooses, for each assignment, the per-stage layer counts that
minimise the slowest stage's time under each stage's memory (:func:`balanced_layout`, a bisection on
the stage time, exact for that objective), emitted as ``parallel.pipeline_layout``. Candidates are then
timed in order of their lower bound, as the homogeneous ones (search.Planner.best).
"""

from __future__ import annotations

import math

from megand.tools.planner.cost import stage_memory_gib, stage_times
from megand.tools.planner.layout import Candidate
from megand.tools.planner.search import RECOMPUTE


def plan_heterogeneous(planner, top: int = 5) -> list:
    """The best heterogeneous plans of ``planner`` (a search.Planner) on its cluster."""
    groups = sorted(planner.cluster.groups, key=lambda g: -g.memory_gib)  # larger memory: earlier stages
    L = planner.shape.layers
    dpn = min(g.devices_per_node for g in groups)
    scored = []
    for tp in planner.tp_domain(dpn):
        for cp in planner.cp_domain(tp):
            max_dp = max(g.devices for g in groups) // (tp * cp)
            dps = [d for d in range(1, max_dp + 1) if planner.gbs % d == 0]
            for dp in planner._dom("parallel.dp", dps):
                size = tp * cp * dp
                caps = [_stages_on(g, size) for g in groups]
                for counts in _assignments(caps, L):
                    stage_groups = [g for g, n in zip(groups, counts) for _ in range(n)]
                    pp = len(stage_groups)
                    if pp < 2 or len({g.name for g in stage_groups}) < 2:
                        continue  # one group only: the homogeneous search covers it
                    if "parallel.pp" in planner.pinned and planner.pinned["parallel.pp"] != pp:
                        continue
                    for mbs in planner.microbatch_domain(dp):
                        for opts in planner.options(tp, cp, dp, pp, dpn):
                            c = Candidate(tp=tp, pp=pp, cp=cp, dp=dp, micro_batch_size=mbs, **opts,
                                          **planner._base())
                            if not planner._quick_valid(c):
                                continue
                            entry = _split(planner, c, stage_groups)
                            if entry:
                                scored.append(entry)
    return planner.best(scored, top)


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


def _split(planner, c: Candidate, stage_groups):
    """The layer split balancing stage time under memory, with the least recompute that fits:
    (lower bound, candidate, groups, times), or None if nothing fits."""
    pinned = planner.pinned.get("parallel.pipeline_layout")
    for recompute in planner._dom("train.recompute", RECOMPUTE):
        base = c.with_(recompute=recompute)
        layout = tuple(pinned) if pinned else balanced_layout(planner, base, stage_groups)
        if layout is None or len(layout) != c.pp:
            continue
        trial = base.with_(pipeline_layout=layout)
        if planner.fits(trial, stage_groups):
            times = stage_times(planner.model, trial, planner.gbs, stage_groups)
            return times.lower_bound(c.pp), trial, list(stage_groups), times
    return None


def balanced_layout(planner, c: Candidate, stage_groups):
    """Layers per stage minimising the slowest stage's time (forward + backward of one micro-batch)
    subject to each stage's memory; None when the layers cannot fit."""
    L, pp = planner.shape.layers, c.pp
    if pp > L:
        return None
    m = planner.gbs // (c.micro_batch_size * c.dp)
    # per-stage time and memory as a + b * layers, from the model at two layer counts
    one = c.with_(pipeline_layout=tuple([1] * pp))
    two = c.with_(pipeline_layout=tuple([2] * pp))
    t1, t2 = stage_times(planner.model, one, planner.gbs, stage_groups), stage_times(planner.model, two, planner.gbs, stage_groups)
    m1, m2 = stage_memory_gib(planner.model, one, m), stage_memory_gib(planner.model, two, m)
    slope = [t2.forward[r] + t2.backward[r] - t1.forward[r] - t1.backward[r] for r in range(pp)]
    fixed = [t1.forward[r] + t1.backward[r] - slope[r] for r in range(pp)]
    caps = []
    for r, g in enumerate(stage_groups):
        per_layer = m2[r] - m1[r]
        room = g.memory_gib - (m1[r] - per_layer)
        caps.append(int(math.floor(room / per_layer + 1e-9)) if per_layer > 0 else L)
    if sum(min(cap, L) for cap in caps) < L or min(caps) < 1:
        return None

    def counts(limit):
        return [max(0, min(caps[r], int(math.floor((limit - fixed[r]) / max(slope[r], 1e-15) + 1e-9)))) for r in range(pp)]

    lo, hi = 0.0, max(fixed[r] + slope[r] * L for r in range(pp))
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(counts(mid)) >= L and min(counts(mid)) >= 1:
            hi = mid
        else:
            lo = mid
    n = counts(hi)
    while sum(n) > L:  # give back layers from the stages that would be slowest
        r = max((r for r in range(pp) if n[r] > 1), key=lambda r: fixed[r] + slope[r] * n[r])
        n[r] -= 1
    return tuple(n) if sum(n) == L and min(n) >= 1 else None
