"""Replicas of different speeds: each data-parallel replica holds the whole model on one cluster group,
and takes its own number of micro-batches per step (``parallel.dp_microbatches``, megand/core/batch_shares.py).

A replica is ``tp x cp x pp`` ranks of one group; each group hosts as many replicas as fit on whole nodes
(each stage's part of the group a whole number of nodes, so every node holds consecutive ranks). For each
such layout the shares are chosen by water-filling (:func:`water_fill`): the step ends when the slowest
replica is done, so the shares minimise ``max_r t_r(k_r)``, ``t_r(k)`` the predicted step of replica r's
group with k micro-batches (its pipeline replayed on k micro-batches, the gradient reduction over every
replica, the optimizer), under the rules a run checks: the shares sum to ``global batch / micro batch``,
each satisfies the pipeline schedule's micro-batch rule (at least its minimum, a multiple of its multiple),
and no group that meets once per micro-batch spans replicas of different shares (core/batch_shares.py:
the planner keeps ZeRO-0/1 here, whose shard groups meet once per step, :data:`ONCE_PER_STEP_SHARDING`
says why; ep is 1 in the planner).

Each plan reports its predicted speed-up over the same layout at equal shares (when the batch splits
evenly), over the best plan of each group alone (the fastest group's among them) and, as the pipeline
plans do, over the sum of the groups' best throughputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

from megand.models.flops import flops_per_iteration
from megand.tools.planner.cost import Prediction, predict, stage_times
from megand.tools.planner.layout import Candidate
from megand.tools.planner.search import MICRO_BATCHES, VPP, Plan

# the sharding levels whose shard groups meet once per step, the only ones offered with uneven shares. ZeRO-2/3
# runs them too (batch_shares.py: phantom micro-batches), but its shard groups meet in every micro-batch, so
# micro-batch j lasts as long as the slowest replica still computing one: a step of sum_j max_{r: k_r > j} t_r
# (t_r: replica r's time per micro-batch) instead of max_r k_r t_r, never faster than ZeRO-1 at the same shares,
# and faster than the even split only where a replica is over twice as fast as a slower one (two replicas:
# (k_fast - k_slow)(t_fast - t_slow / 2) < 0): a plan that needs ZeRO-2/3's memory runs its replicas evenly
ONCE_PER_STEP_SHARDING = ("none", "optim")


def water_fill(times: Sequence[Callable[[int], float]], total: int, minimum: int = 1, multiple: int = 1):
    """Shares ``k_r`` (one per replica, ``times[r](k)`` its nondecreasing step time with k micro-batches)
    summing to ``total``, each at least ``minimum`` and a multiple of ``multiple``, that minimise the
    slowest replica's time: ``(shares, slowest)``, or None when no shares satisfy the rules.

    In units of ``multiple`` the shares are integers from ``lo``; a threshold T admits at most
    ``count_r(T)`` units on replica r (a bisection on its nondecreasing time), so the least feasible T
    (``sum_r count_r(T) >= total``) is found by bisection over the times themselves, then the units above
    ``total`` are taken back from the replicas that would finish last. Each ``times[r]`` is called once per
    distinct argument (memoised here)."""
    n = len(times)
    if n == 0 or total % multiple:
        return None
    units, lo = total // multiple, -(-max(minimum, 1) // multiple)
    if units < n * lo:
        return None
    memo = [{} for _ in range(n)]

    def t(r, j):
        if j not in memo[r]:
            memo[r][j] = times[r](j * multiple)
        return memo[r][j]

    hi_units = units - (n - 1) * lo  # the most one replica can take

    def count(r, limit):
        """Units replica r may take within ``limit`` (lo - 1: not even its minimum)."""
        if t(r, lo) > limit:
            return lo - 1
        a, b = lo, hi_units
        while a < b:
            mid = (a + b + 1) // 2
            if t(r, mid) <= limit:
                a = mid
            else:
                b = mid - 1
        return a

    def feasible(limit):
        counts = [count(r, limit) for r in range(n)]
        return counts if min(counts) >= lo and sum(counts) >= units else None

    # the optimum is one of the values t(r, j): bisect on the sorted distinct values seen so far, then on reals
    low = max(t(r, lo) for r in range(n))  # every replica runs at least its minimum
    high = max(t(r, hi_units) for r in range(n))
    if feasible(low):
        high = low
    else:
        for _ in range(200):
            mid = (low + high) / 2
            if mid <= low or mid >= high:
                break
            if feasible(mid):
                high = mid
            else:
                low = mid
    counts = feasible(high)
    while sum(counts) > units:  # give back units from the replicas that finish last
        r = max((r for r in range(n) if counts[r] > lo), key=lambda r: (t(r, counts[r]), r))
        counts[r] -= 1
    shares = tuple(j * multiple for j in counts)
    return shares, max(t(r, counts[r]) for r in range(n))


def replicas_on(group, ranks_per_stage: int, pp: int) -> int:
    """Replicas of ``ranks_per_stage x pp`` ranks ``group`` hosts with each stage's part of the group on whole
    nodes (the consecutive ranks a node's processes get), or 0."""
    dpn = group.devices_per_node
    n = group.devices // (ranks_per_stage * pp)
    while n > 0 and (ranks_per_stage * n) % dpn:
        n -= 1
    return n


@dataclass(frozen=True)
class ReplicaPlacement:
    """``node_of[rank]``: (group name, node index); ``nodes``: the launch order (node rank 0 first)."""

    node_of: tuple
    nodes: tuple


def place_replicas(c: Candidate, replica_groups) -> Optional[ReplicaPlacement]:
    """Ranks on nodes: data-parallel replica r on group ``replica_groups[r]``, each rank on its group's next
    free device in rank order; None when some node would not hold consecutive ranks (then no launcher
    can start it)."""
    layout = c.parallel
    used, node_of = {}, []
    for rank in range(layout.world_size):
        g = replica_groups[layout.coords(rank)["dp"]]
        i = used.get(g.name, 0)
        node_of.append((g.name, i // g.devices_per_node))
        used[g.name] = i + 1
    nodes = tuple(dict.fromkeys(node_of))
    runs = [node_of[0]] + [b for a, b in zip(node_of, node_of[1:]) if a != b]
    if len(runs) != len(nodes):
        return None
    return ReplicaPlacement(node_of=tuple(node_of), nodes=nodes)


@dataclass
class ReplicaPlan(Plan):
    """A plan whose data-parallel replicas run on different groups (``replica_groups[r]``) with their own
    shares (the candidate's ``parallel.dp_microbatches``)."""

    replica_groups: tuple = ()
    placement: Optional[ReplicaPlacement] = None
    replica_step_s: dict = field(default_factory=dict)  # group name -> predicted step of its replicas
    even_step_s: Optional[float] = None  # the same layout at equal shares (None: the batch does not split so)
    gbs: int = 0  # the global batch (equal shares: its even split)

    @property
    def shares(self) -> tuple:
        c = self.candidate
        return c.parallel.dp_microbatches or (c.parallel.microbatches(self.gbs, c.micro_batch_size),) * c.dp

    def speedups(self) -> dict:
        """Predicted throughput ratios: over equal shares, over each group alone and the fastest alone."""
        out = {"even_split": self.even_step_s / self.prediction.step_time_s} if self.even_step_s else {}
        return {**out, **super().speedups()}

    def launch(self) -> dict:
        p = self.placement
        return {"replicas": [g.name for g in self.replica_groups], "dp_microbatches": list(self.shares),
                "nodes": [f"{name}:{index}" for name, index in p.nodes],
                "nproc_per_node": [sum(1 for n in p.node_of if n == node) for node in p.nodes]}

    def as_dict(self) -> dict:
        d = super().as_dict()
        d["speedup"] = self.speedups()
        d["replica_step_s"] = self.replica_step_s
        return d


def replica_candidates(planner, groups):
    """``(candidate, replicas per group)`` of every replica layout spanning at least two groups, before
    memory (no recompute yet): tp and cp within the smallest node, pp up to the layers, ZeRO-0/1 (see the
    module docstring), every schedule and micro-batch size the homogeneous search tries."""
    L = planner.shape.layers
    dpn = min(g.devices_per_node for g in groups)
    for tp in planner.tp_domain(dpn):
        for cp in planner.cp_domain(tp):
            for pp in planner._dom("parallel.pp", range(1, L + 1)):
                counts = [replicas_on(g, tp * cp, pp) for g in groups]
                if sum(1 for n in counts if n) < 2:
                    continue  # one group only: the homogeneous search covers it
                counts = [n for n in counts if n]
                dp = sum(counts)
                if planner.pinned.get("parallel.dp") not in (None, dp):
                    continue
                vpps = [None] + [v for v in VPP if pp > 1 and pp * v <= L]
                for vpp in planner._dom("parallel.vpp", vpps if pp > 1 else [None]):
                    schedules = planner.schedules(pp, vpp)
                    for layout in (planner.layouts(pp, vpp) if schedules else []):
                        for mbs in planner._dom("train.micro_batch_size", MICRO_BATCHES):
                            if planner.gbs % mbs or planner.gbs // mbs < dp:
                                continue
                            for opts in planner.options(tp, cp, dp, pp, dpn):
                                if opts["sharding"] not in ONCE_PER_STEP_SHARDING:
                                    continue
                                for schedule in schedules:
                                    c = Candidate.or_none(tp=tp, pp=pp, vpp=vpp, cp=cp, dp=dp, micro_batch_size=mbs,
                                                          pipeline_layout=layout, pp_schedule=schedule, **opts,
                                                          **planner._base())
                                    if c is not None and _quick_valid(planner, c):
                                        yield c, counts


def _quick_valid(planner, c: Candidate) -> bool:
    """The model's rules of the search's own quick check (the batch rules are the shares')."""
    s, layout = planner.shape, c.parallel
    if c.cp > 1 and c.cp_comm == "a2a" and (s.heads // c.tp) % c.cp:
        return False
    if s.seq % layout.sequence_multiple(c.sequence_parallel):
        return False
    return not (c.sharding == "none" and layout.shard_size != layout.dp_cp)


class ReplicaTimes:
    """One group's replicas of candidate ``c``: the predicted step with k micro-batches each (memoised)."""

    def __init__(self, planner, c: Candidate, group):
        self.planner, self.c, self.group = planner, c, group
        self.groups = [group] * c.pp
        self.times = stage_times(planner.model, c, planner.gbs, self.groups)
        self._steps = {}

    def prediction(self, k: int) -> Prediction:
        if k not in self._steps:
            c = self.c
            self._steps[k] = predict(self.planner.model, c, k * c.micro_batch_size * c.dp, self.groups,
                                     times=replace(self.times, microbatches=k), memory=[0.0] * c.pp)
        return self._steps[k]

    def step(self, k: int) -> float:
        return self.prediction(k).step_time_s


def replica_plan(planner, c: Candidate, groups, counts, per_group=None) -> Optional[ReplicaPlan]:
    """The water-filled shares of candidate ``c`` (its dp replicas, ``counts[i]`` on ``groups[i]``), as a plan
    with its predicted step and memory; None if no shares satisfy the rules or a group runs out of memory."""
    total = planner.gbs // c.micro_batch_size
    per_group = per_group or [ReplicaTimes(planner, c, g) for g in groups]
    pinned = planner.pinned.get("parallel.dp_microbatches")
    rule = c.parallel.schedule.microbatch_rule(c.pp, c.vpp)
    replica_groups = tuple(g for g, n in zip(groups, counts) for _ in range(n))
    times = [rt.step for rt, n in zip(per_group, counts) for _ in range(n)]
    if pinned is not None:
        shares = tuple(int(k) for k in pinned)
        if len(shares) != c.dp or sum(shares) != total or any(rule.error(k) for k in shares):
            return None
    else:
        filled = water_fill(times, total, rule.minimum, rule.multiple)
        if filled is None:
            return None
        shares = filled[0]
    step_of = {}
    for g, k in zip(replica_groups, shares):
        step_of[g.name] = max(step_of.get(g.name, 0.0), per_group[groups.index(g)].step(k))
    memory = []  # per stage: the most loaded group's peak, against its own device memory (the worst ratio)
    for i, g in enumerate(groups):
        most = max(k for gg, k in zip(replica_groups, shares) if gg is g)
        mem = planner.memory(c, microbatches=most)
        if any(x > g.memory_gib for x in mem):
            return None
        memory.append([(x, g.memory_gib) for x in mem])
    worst = [max((stage[s] for stage in memory), key=lambda x: x[0] / x[1]) for s in range(c.pp)]
    uneven = len(set(shares)) > 1
    planned = c.with_(dp_microbatches=shares if uneven else None)
    placement = place_replicas(planned, replica_groups)
    if placement is None:
        return None
    slowest = max(zip(replica_groups, shares), key=lambda gk: per_group[groups.index(gk[0])].step(gk[1]))
    base = per_group[groups.index(slowest[0])].prediction(slowest[1])
    step = max(step_of.values())
    flops = flops_per_iteration(planner.model, planner.gbs, c.recompute)
    peak = sum(g.profile.peak_tflops * n for g, n in zip(groups, counts)) * c.tp * c.cp * c.pp * 1e12
    prediction = Prediction(step_time_s=step, tokens_per_s=flops["tokens"] / step,
                            tflops_per_device=flops["hardware_flops"] / step / c.world_size / 1e12,
                            mfu=flops["model_flops"] / step / peak, bubble_fraction=base.bubble_fraction,
                            mem_peak_gib=[x for x, _ in worst], memory_gib=[cap for _, cap in worst],
                            parts={**base.parts, "replica_step_s": step_of})
    even = None
    if total % c.dp == 0 and rule.error(total // c.dp) is None:
        even = max(rt.step(total // c.dp) for rt in per_group)
    return ReplicaPlan(candidate=planned, stage_groups=tuple(groups), prediction=prediction,
                       replica_groups=replica_groups, placement=placement, replica_step_s=step_of,
                       even_step_s=even, gbs=planner.gbs)


def plan_shares(planner, top: int = 5, alone: dict | None = None, ceiling: float = float("inf")) -> list:
    """The best replica plans of ``planner`` (a search.Planner) on its cluster, best first; ``alone``: each
    group's best throughput alone (for the speed-ups). Layouts are weighed in order of a lower bound (each
    replica's busiest rank's compute per micro-batch, water-filled as if shares were continuous:
    T >= total / sum_g(n_g / busy_g)); only those that can still enter the top ``top`` are checked against
    the memory and water-filled. ``ceiling``: a step no plan of interest reaches (the caller's top so far:
    layouts whose bound is at or above it are never water-filled)."""
    groups = list(planner.cluster.groups)
    smallest = min(groups, key=lambda g: g.memory_gib)
    bases = []
    for c, counts in replica_candidates(planner, groups):
        used = [g for g in groups if replicas_on(g, c.tp * c.cp, c.pp)]
        # each replica runs at least its busiest rank's compute per micro-batch (planner.compute_bound: also
        # a bound for every sharding and recompute choice of this layout)
        busy = [planner.compute_bound(c, [g] * c.pp, fill=False) / c.parallel.microbatches(planner.gbs, c.micro_batch_size)
                for g in used]
        bound = (planner.gbs // c.micro_batch_size) / sum(n / b for n, b in zip(counts, busy))
        bases.append((bound, len(bases), c, used, counts))
        if planner.out_of_time():
            break
    bases.sort(key=lambda x: x[:2])
    plans = []
    for bound, _, base, used, counts in bases:
        if bound >= ceiling or (len(plans) >= top and bound >= plans[-1].prediction.step_time_s):
            break
        if plans and planner.out_of_time():
            break
        for c in planner._fitting(base, [smallest] * base.pp):
            plan = replica_plan(planner, c, used, counts)
            if plan is None or (len(plans) >= top and plan.prediction.step_time_s >= plans[-1].prediction.step_time_s):
                continue
            if not planner._validated(plan.candidate):
                continue
            plan.alone_tokens_per_s = dict(alone or {})
            total = sum(plan.alone_tokens_per_s.values())
            plan.hetero_ratio = plan.prediction.tokens_per_s / total if total else None
            plans.append(plan)
            plans.sort(key=lambda p: p.prediction.step_time_s)
            del plans[top:]
    return plans


def format_shares(plan: ReplicaPlan) -> str:
    """Why this plan: the replicas, their shares and predicted steps, and its speed-ups."""
    by_group = {}
    for g, k in zip(plan.replica_groups, plan.shares):
        by_group.setdefault(g.name, []).append(k)
    parts = [f"{name}: {len(ks)} replica(s) x {'/'.join(map(str, sorted(set(ks))))} micro-batches, "
             f"{plan.replica_step_s[name]:.3f} s" for name, ks in by_group.items()]
    s = plan.speedups()
    ratios = []
    if "even_split" in s:
        ratios.append(f"{s['even_split']:.3f} x the even split")
    if "fastest_group_alone" in s:
        ratios.append(f"{s['fastest_group_alone']:.3f} x the fastest group alone")
    ratios += [f"{v:.3f} x {k[:-len('_alone')]} alone" for k, v in s.items()
               if k.endswith("_alone") and k != "fastest_group_alone" and v is not None]
    return (f"   replica shares parallel.dp_microbatches={list(plan.shares)} ({'; '.join(parts)}); predicted speed-up: "
            f"{', '.join(ratios) or 'none to compare'}")


def is_replica_plan(plan) -> bool:
    return isinstance(plan, ReplicaPlan)
