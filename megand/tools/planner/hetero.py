"""Heterogeneous search (H2's HeteroAuto in spirit): stages homogeneous, each on one cluster group.

tp, cp and dp are uniform (megand's grid), so every stage has S = tp*cp*dp ranks. A depth-first search
over dp and over how many stages each group hosts (groups in order of decreasing device memory: the
early stages hold the most micro-batches in flight under 1F1B; a large group split into several
stages; pp never above the layer count) chooses, for each assignment, the per-stage layer counts that
minimise the slowest stage's time under each stage's memory (:func:`balanced_layout`, a bisection on
the stage time, exact for that objective), emitted as ``parallel.pipeline_layout``. With per-stage
recompute (``train.recompute_layers`` not pinned) each stage may also recompute only some of its layers:
:func:`balanced_recomputing_layout` balances the layers knowing that a stage with spare memory stores
its activations and one short of memory recomputes the fewest layers that fit (H2 tunes each chip
type's stages to its resources the same way), then each stage's exact fewest recomputed layers are
found on the estimator (search.Planner.fewest_recomputed). Candidates are then timed in order of their
lower bound, as the homogeneous ones (search.Planner.best).
"""

from __future__ import annotations

import bisect
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
                            for schedule in planner.schedules(pp):
                                c = Candidate(tp=tp, pp=pp, cp=cp, dp=dp, micro_batch_size=mbs, pp_schedule=schedule,
                                              **opts, **planner._base())
                                if planner._quick_valid(c):
                                    scored += _split(planner, c, stage_groups)
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
            if layout is not None and len(layout) == c.pp and planner.fits(base.with_(pipeline_layout=layout),
                                                                             stage_groups):
                trials.append(base.with_(pipeline_layout=layout))
                if recompute == "none" or not planner.per_stage_recompute:
                    break
        if recompute != "none" and planner.per_stage_recompute:
            layout = tuple(pinned) if pinned else balanced_recomputing_layout(planner, base, stage_groups)
            if layout is not None and len(layout) == c.pp:
                full = base.with_(pipeline_layout=layout)
                if planner.fits(full, stage_groups):
                    fewer = planner.fewest_recomputed(full, stage_groups)
                    if fewer not in trials:
                        trials.append(fewer)
    entries = []
    for trial in trials:
        times = stage_times(planner.model, trial, planner.gbs, stage_groups)
        entries.append((times.lower_bound(c.pp), trial, list(stage_groups), times))
    return entries


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


def balanced_recomputing_layout(planner, c: Candidate, stage_groups):
    """Layers per stage minimising the slowest stage's time when each stage recomputes (with ``c.recompute``)
    only the fewest of its layers that fit its memory; None when the layers cannot fit.

    Per stage, time and memory are linear in its layers n and recomputed layers k (from the cost model
    and the estimator at a few points): t = fixed + slope·n + extra·k, memory = base + per_layer·n, less
    ``saved`` per recomputed layer plus the recomputation's working set once k > 0. Its fastest fitting
    time is then nondecreasing in n, and a bisection on the slowest stage's time gives the split."""
    L, pp = planner.shape.layers, c.pp
    if pp > L:
        return None
    m = planner.gbs // (c.micro_batch_size * c.dp)
    model, gbs = planner.model, planner.gbs
    stored = c.with_(recompute="none", recompute_layers=None)
    t1 = stage_times(model, stored.with_(pipeline_layout=tuple([1] * pp)), gbs, stage_groups)
    t2 = stage_times(model, stored.with_(pipeline_layout=tuple([2] * pp)), gbs, stage_groups)
    tr = stage_times(model, c.with_(pipeline_layout=tuple([1] * pp), recompute_layers=None), gbs, stage_groups)
    m1 = stage_memory_gib(model, stored.with_(pipeline_layout=tuple([1] * pp)), m)
    m2 = stage_memory_gib(model, stored.with_(pipeline_layout=tuple([2] * pp)), m)
    m21 = stage_memory_gib(model, c.with_(pipeline_layout=tuple([2] * pp), recompute_layers=tuple([1] * pp)), m)
    m22 = stage_memory_gib(model, c.with_(pipeline_layout=tuple([2] * pp), recompute_layers=None), m)
    table = []
    for r, g in enumerate(stage_groups):
        slope = t2.forward[r] + t2.backward[r] - t1.forward[r] - t1.backward[r]
        fixed = t1.forward[r] + t1.backward[r] - slope
        extra = tr.forward[r] + tr.backward[r] - t1.forward[r] - t1.backward[r]
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
    if sum(counts(hi)) < L or min(counts(hi)) < 1:
        return None
    for _ in range(60):
        mid = (lo + hi) / 2
        n = counts(mid)
        if sum(n) >= L and min(n) >= 1:
            hi = mid
        else:
            lo = mid
    n = counts(hi)
    while sum(n) > L:  # give back layers from the stages that would be slowest
        r = max((r for r in range(pp) if n[r] > 1), key=lambda r: table[r][n[r]])
        n[r] -= 1
    return tuple(n) if sum(n) == L and min(n) >= 1 else None


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
