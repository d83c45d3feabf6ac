"""The search: every layout worth running on a cluster, best predicted throughput first.

Homogeneous (one group): tp (a divisor of the heads, query groups and ffn width, inside a node), cp,
pp (dividing what is left of the devices), vpp, the micro-batch size, the sharding level, hybrid
sharding (one node's ranks per shard group), sequence parallelism (on with tp), cp_comm and the least
recompute that fits (and, unless ``train.recompute_layers`` is pinned, each rank recomputing only the
fewest of its layers that fit its memory: ranks with fewer micro-batches in flight recompute less), the
pipeline schedule (every registered one, megand/core/pipeline_parallel/orders/, each replayed on its own
action list and counted with its own activations in flight; which schedule runs with which vpp and
micro-batch count is its record's rule, the one the training config checks); dp takes the devices left
(the largest that divides the batch). Every pinned key
(a ``parallel.*``, ``optim.*`` or ``train.*`` override the user gave) keeps its value. Candidates that
do not fit the device memory on every stage (megand/tools/estimate_memory.py) are dropped before any
timing; the rest are timed in order of a lower bound (the busiest rank's compute) until no remaining
one can enter the top k (branch and bound), and a plan is kept only if the training config's own
``validate()`` accepts it.

Heterogeneous (several groups): hetero.py, a depth-first search over dp, the stages each group hosts
and the per-stage layer split; its candidates go through the same memory check, bound and validate().
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from megand.core.batch_shares import is_uneven
from megand.core.parallel_layout import LayoutError
from megand.core.pipeline_parallel.registry import DEFAULT_SCHEDULE, schedule_error, schedule_names
from megand.models.flops import FrozenModel, Shape
from megand.tools.estimate_memory import estimate_memory, hand_off_bytes, virtual_stage_sizes
from megand.tools.planner.cost import (GIB, Prediction, memory_layout, predict, rank_virtual_stages,
                                       stage_memory_gib, stage_times)
from megand.tools.planner.layout import Candidate, override_value, place, planned_layout

SHARDING = ("none", "optim", "optim_grads", "optim_grads_params")
RECOMPUTE = ("none", "selective", "full")
CP_COMM = ("p2p", "all_gather", "a2a")
MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
VPP = (2, 3, 4, 6, 8)
CP = (1, 2, 4, 8, 16, 32)

# the config keys the planner chooses (a pinned one keeps the user's value)
SEARCHED = ("parallel.tp", "parallel.pp", "parallel.vpp", "parallel.cp", "parallel.dp",
            "parallel.sequence_parallel", "parallel.dp_shard", "parallel.dp_microbatches", "parallel.cp_comm", "parallel.pipeline_layout",
            "parallel.order", "optim.sharding", "optim.overlap_grad_reduce", "optim.overlap_param_gather",
            "optim.reshard_after_forward", "optim.bucket_size", "train.micro_batch_size", "train.recompute",
            "train.recompute_layers", "train.precision", "parallel.pp_schedule")


def config_validator(cfg):
    """The training config's validate() with a candidate's keys set: returns its message, or None."""
    from omegaconf import OmegaConf

    from megand.training.config import ConfigError, validate

    trial = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    OmegaConf.set_struct(trial, True)

    def check(candidate):
        for key, value in candidate.settings().items():
            OmegaConf.update(trial, key, value, merge=False)
        try:
            validate(trial, candidate.world_size)
        except ConfigError as e:
            return str(e)
        return None

    return check


def spread(k: int, sizes: list) -> list:
    """``k`` recomputed layers over model chunks of ``sizes`` layers, one chunk after the other in turn."""
    out = [0] * len(sizes)
    while k > 0:
        for j, size in enumerate(sizes):
            if k > 0 and out[j] < size:
                out[j] += 1
                k -= 1
    return out


class PlanError(ValueError):
    """No plan: the message says why in one line."""


@dataclass
class Plan:
    candidate: Candidate
    stage_groups: tuple
    prediction: Prediction
    hetero_ratio: Optional[float] = None  # plan throughput / summed best homogeneous throughput per group
    notes: list = field(default_factory=list)
    alone_tokens_per_s: dict = field(default_factory=dict)  # group name -> its best plan alone (heterogeneous plans)

    def speedups(self) -> dict:
        """Predicted throughput ratios over each group's best plan alone and over the fastest of them."""
        out = {}
        tps = self.prediction.tokens_per_s
        for name, alone in self.alone_tokens_per_s.items():
            out[f"{name}_alone"] = tps / alone if alone else None
        alone = [v for v in self.alone_tokens_per_s.values() if v]
        if alone:
            out["fastest_group_alone"] = tps / max(alone)
        return out

    @property
    def world_size(self) -> int:
        return self.candidate.world_size

    def overrides(self) -> list:
        return [f"{k}={override_value(v)}" for k, v in self.candidate.settings().items()]

    def launch(self) -> dict:
        placement = place(self.candidate, self.stage_groups)
        return {"stages": [g.name for g in self.stage_groups],
                "nodes": [f"{name}:{index}" for name, index in placement.nodes],
                "nproc_per_node": [sum(1 for n in placement.node_of if n == node) for node in placement.nodes]}

    def as_dict(self) -> dict:
        d = {"overrides": self.overrides(), "world_size": self.world_size, "stage_groups": self.launch(),
             "predicted": self.prediction.as_dict()}
        if self.hetero_ratio is not None:
            d["hetero_speedup_ratio"] = self.hetero_ratio
        if self.alone_tokens_per_s:
            d["speedup"] = self.speedups()
        if self.candidate.stage_widths is not None:
            d["stage_widths"] = [{"tp": tp, "sp": sp} for tp, sp in self.candidate.stage_widths]
        return d


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


class Planner:
    """Search layouts of ``cfg`` (the composed training config) with ``pinned`` keys fixed. ``schedules``:
    the pipeline schedules to try (default: all; ``parallel.pp_schedule`` pinned: that one)."""

    def __init__(self, cfg, pinned, cluster, validate_fn=None, schedules=None, time_budget_s=None):
        from omegaconf import OmegaConf

        self.cfg = cfg
        self.model = FrozenModel(OmegaConf.to_container(cfg.model, resolve=True))  # its shape computed once
        self.shape = Shape.from_config(self.model)
        self.gbs = int(cfg.train.global_batch_size)
        self.cluster = cluster
        self.pinned = {k: OmegaConf.select(cfg, k) for k in pinned if k in SEARCHED}
        self.validate_fn = validate_fn
        self.rejected = []
        self._memory = {}  # (estimator layout, stage) -> peak GiB
        self._bounds = {}  # compute_bound's answers
        self._times = {}  # cost.stage_times' answers (cost.times_key, stage groups) -> StageTimes
        self._config_keys = None  # _base()'s values read from the config
        self.fused_attention = None  # None: megand's SDPA (fused in 16-bit); False: a system that stores s x s  # (candidate, validate's message) of plans validate() refused
        profiles = {g.profile.dtype for g in cluster.groups}
        self.precision = self.pinned.get("train.precision") or ("fp32" if profiles == {"fp32"} else "bf16")
        self.schedule_domain = self._schedule_domain(schedules)
        self.finish_by = None if time_budget_s is None else time.monotonic() + time_budget_s
        self.deadline = self.finish_by  # the current phase's share of the budget (plan())
        self.cut = False  # the time budget ran out: the plans are the best found so far

    def _start_phase(self, phases_left: int) -> None:
        """Give the next phase of :meth:`plan` its even share of what is left of the budget (a phase that
        finishes early leaves its time to the next), so that no phase starves the others."""
        if self.finish_by is not None:
            now = time.monotonic()
            self.deadline = now + max(self.finish_by - now, 0.0) / phases_left

    def out_of_time(self) -> bool:
        """The current phase's share of the time budget is spent (then :attr:`cut` says the search stopped
        early)."""
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.cut = True
            return True
        return False

    def _schedule_domain(self, schedules) -> tuple:
        """The schedules searched: ``schedules`` (or all); a pinned ``parallel.pp_schedule`` alone. An
        unknown name: PlanError."""
        pinned = self.pinned.get("parallel.pp_schedule")
        known = schedule_names()
        asked = (pinned,) if pinned is not None else tuple(schedules) if schedules is not None else known
        unknown = [s for s in asked if s not in known]
        if unknown or not asked:
            raise PlanError(f"unknown pipeline schedule(s) {', '.join(map(str, unknown)) or '(none given)'}: "
                            f"choose from {', '.join(known)}")
        return asked

    # --- domains of each key --------------------------------------------------------------------
    def _dom(self, key, values):
        return [self.pinned[key]] if key in self.pinned else list(values)

    def tp_domain(self, devices_per_node: int) -> list:
        s = self.shape
        ok = [t for t in _divisors(devices_per_node)
              if s.heads % t == 0 and s.groups % t == 0 and s.ffn % t == 0]
        return self._dom("parallel.tp", ok)

    def cp_domain(self, tp: int) -> list:
        seq = self.shape.seq
        return self._dom("parallel.cp", [c for c in CP if c == 1 or seq % (2 * c * (tp if tp > 1 else 1)) == 0])

    def layouts(self, pp: int, vpp):
        """Pipeline layouts to try: the pinned one, the even split, or (layers not divisible) one that
        gives the first and last virtual stages the fewer layers (they also hold the embedding and the
        output layer)."""
        if "parallel.pipeline_layout" in self.pinned:
            return [tuple(self.pinned["parallel.pipeline_layout"]) if self.pinned["parallel.pipeline_layout"]
                    else None]
        stages = pp * (vpp or 1)
        L = self.shape.layers
        if stages > L:
            return []
        if L % stages == 0:
            return [None]
        base, extra = divmod(L, stages)
        order = list(range(1, stages - 1)) + [0, stages - 1]  # middle stages first
        layout = [base] * stages
        for s in order[:extra]:
            layout[s] += 1
        return [tuple(layout)]

    def microbatch_domain(self, dp: int) -> list:
        per_rank = self.gbs // dp
        return self._dom("train.micro_batch_size", [b for b in MICRO_BATCHES if per_rank % b == 0])

    def dp_for(self, devices: int, model_ranks: int) -> Optional[int]:
        if "parallel.dp" in self.pinned and self.pinned["parallel.dp"] is not None:
            dp = int(self.pinned["parallel.dp"])
            return dp if dp * model_ranks <= devices else None
        for dp in range(devices // model_ranks, 0, -1):
            if self.gbs % dp == 0:
                return dp
        return None

    def options(self, tp: int, cp: int, dp: int, pp: int, devices_per_node: int):
        """(sp, sharding, dp_shard, cp_comm, overlap flags, reshard) combinations for a grid."""
        sp_dom = self._dom("parallel.sequence_parallel", [tp > 1])
        shard_ranks = dp * cp
        sharding_dom = self._dom("optim.sharding", SHARDING if shard_ranks > 1 else ("none",))
        comm_dom = self._dom("parallel.cp_comm", CP_COMM if cp > 1 else (self.cfg.parallel.cp_comm,))
        for sp in sp_dom:
            for sharding in sharding_dom:
                hsdp = devices_per_node // (tp * 1)
                shards = [None]
                if sharding != "none" and 1 < hsdp < shard_ranks and shard_ranks % hsdp == 0:
                    shards.append(hsdp)
                for dp_shard in self._dom("parallel.dp_shard", shards):
                    for cp_comm in comm_dom:
                        yield dict(
                            sequence_parallel=sp, sharding=sharding, dp_shard=dp_shard, cp_comm=cp_comm,
                            overlap_grad_reduce=self.pinned.get("optim.overlap_grad_reduce", shard_ranks > 1),
                            overlap_param_gather=self.pinned.get("optim.overlap_param_gather",
                                                                 sharding in ("optim", "optim_grads")),
                            reshard_after_forward=self.pinned.get("optim.reshard_after_forward", pp == 1))

    def _base(self) -> dict:
        """The candidate keys the search does not vary (read from the config once: OmegaConf reads cost
        milliseconds, and every candidate asks)."""
        if self._config_keys is None:
            self._config_keys = dict(
                optimizer=self.cfg.optim.name, fp8=self.cfg.train.get("fp8"),
                fp8_bf16_layers=int(self.cfg.train.get("fp8_bf16_layers", 1)),
                order=self.pinned.get("parallel.order", self.cfg.parallel.order),
                bucket_size=int(self.pinned.get("optim.bucket_size", self.cfg.optim.bucket_size)))
        return dict(precision=self.precision, fused_attention=self.fused_attention, **self._config_keys)

    def memory(self, c: Candidate, stages=None, microbatches=None) -> list:
        """Peak GiB of ``stages`` (default all) with ``microbatches`` per step (default: the global batch's
        even split), memoised: many candidates differ only in what memory does not see."""
        m = c.parallel.microbatches(self.gbs, c.micro_batch_size) if microbatches is None else microbatches
        stages = tuple(range(c.pp)) if stages is None else tuple(stages)
        if c.stage_widths is not None:  # each stage as the one-width layout of its width (asked once per width
            by_width = {}  # and shared by every candidate with that width), plus the hand-off between widths
            for r in stages:
                by_width.setdefault(c.stage_widths[r], []).append(r)
            peak = {}
            for ranks in by_width.values():
                peak.update(zip(ranks, self.memory(c.of_rank(ranks[0]), ranks, m)))
            layout = memory_layout(c, m)
            return [peak[r] + hand_off_bytes(self.model, layout, r) / GIB for r in stages]
        layout = memory_layout(c, m)
        missing = [s for s in stages if (layout, s) not in self._memory]  # cached per stage: fits() asks for
        if missing:  # all of them, fewest_recomputed for one at a time
            for st in estimate_memory(self.model, layout, stages=missing).stages:
                self._memory[(layout, st.stage)] = st.total_bytes / GIB
        return [self._memory[(layout, s)] for s in stages]

    def times(self, c: Candidate, stage_groups):
        """:func:`cost.stage_times` of ``c`` on ``stage_groups``, memoised (shared: not to be changed)."""
        return stage_times(self.model, c, self.gbs, stage_groups, self._times)

    def fits(self, c: Candidate, stage_groups) -> bool:
        """Every stage within its device memory. On one group with an even split and the output layer on
        the last rank only the first and last stages need checking: the others hold fewer micro-batches
        than the first and no embedding or output layer."""
        if (len({g.name for g in stage_groups}) == 1 and c.pipeline_layout is None and c.recompute_layers is None
                and c.parallel.last_stage_rank == c.pp - 1):
            stages = sorted({0, c.pp - 1})
            return all(x <= stage_groups[0].memory_gib for x in self.memory(c, stages))
        return all(x <= g.memory_gib for x, g in zip(self.memory(c), stage_groups))

    @property
    def per_stage_recompute(self) -> bool:
        """Whether each rank's recomputed layers are searched (``train.recompute_layers`` not pinned)."""
        return "train.recompute_layers" not in self.pinned

    def _fitting(self, candidate: Candidate, stage_groups) -> list:
        """The candidates that fit: the least recompute applied to every layer (or the pinned one) and, with
        :attr:`per_stage_recompute`, each recompute mode with the fewest layers per rank that fit."""
        pinned = self.pinned.get("train.recompute_layers")
        fits = []
        for recompute in self._dom("train.recompute", RECOMPUTE):
            if recompute == "none" and pinned is not None:
                continue
            c = candidate.with_(recompute=recompute, recompute_layers=tuple(pinned) if pinned is not None else None)
            if not self.fits(c, stage_groups):
                continue
            if recompute == "none" or not self.per_stage_recompute:
                return fits or [c]
            if not fits:
                fits.append(c)
            fewer = self.fewest_recomputed(c, stage_groups)
            if fewer != c:
                fits.append(fewer)
        return fits

    def fewest_recomputed(self, c: Candidate, stage_groups) -> Candidate:
        """``c`` (which fits with every layer recomputing) with each rank recomputing the fewest of its
        layers that fit its device: a bisection per rank (its memory falls with each layer that
        recomputes; the others' counts do not change it), the count spread over its model chunks."""
        m = c.parallel.microbatches(self.gbs, c.micro_batch_size)
        sizes = [int(n) for n in virtual_stage_sizes(self.shape.layers, memory_layout(c, m))]
        counts = list(sizes)
        for r, slots in enumerate(rank_virtual_stages(c)):  # this rank's virtual stages
            mine = [sizes[j] for j in slots]

            def with_count(k, base):
                trial = list(base)
                for j, n in zip(slots, spread(k, mine)):
                    trial[j] = n
                return trial

            lo, hi = 0, sum(mine)
            while lo < hi:
                mid = (lo + hi) // 2
                trial = c.with_(recompute_layers=tuple(with_count(mid, sizes)))
                if self.memory(trial, [r])[0] <= stage_groups[r].memory_gib:
                    hi = mid
                else:
                    lo = mid + 1
            counts = with_count(lo, counts)
        return c if counts == sizes else c.with_(recompute_layers=tuple(counts))

    def schedules(self, pp: int, vpp) -> list:
        """The pipeline schedules to try for ``pp`` stages of ``vpp`` chunks per rank (of
        :attr:`schedule_domain`, those whose record takes this vpp; the micro-batch rules are checked per
        candidate)."""
        if pp == 1:  # no pipeline: the default, unless a pinned schedule cannot run without one
            pinned = self.pinned.get("parallel.pp_schedule", DEFAULT_SCHEDULE)
            return [DEFAULT_SCHEDULE] if schedule_error(pinned, 1, None, 1) is None else []
        return [s for s in self.schedule_domain if schedule_error(s, pp, vpp, 2 * pp) is None]

    # --- homogeneous ----------------------------------------------------------------------------
    def homogeneous_bases(self, group):
        """Every layout on ``group`` alone that the search weighs, before memory (no recompute yet):
        :meth:`_fitting` turns each into the candidates that fit."""
        L = self.shape.layers
        for tp in self.tp_domain(group.devices_per_node):
            for cp in self.cp_domain(tp):
                if tp * cp > group.devices:
                    continue
                left = group.devices // (tp * cp)
                pps = [p for p in _divisors(left) if p <= L]
                for pp in self._dom("parallel.pp", pps):
                    dp = self.dp_for(group.devices, tp * cp * pp)
                    if dp is None:
                        continue
                    vpps = [None] + [v for v in VPP if pp > 1 and pp * v <= L]
                    for vpp in self._dom("parallel.vpp", vpps if pp > 1 else [None]):
                        schedules = self.schedules(pp, vpp)
                        for layout in (self.layouts(pp, vpp) if schedules else []):
                            for mbs in self.microbatch_domain(dp):
                                for opts in self.options(tp, cp, dp, pp, group.devices_per_node):
                                    for schedule in schedules:
                                        c = Candidate.or_none(tp=tp, pp=pp, vpp=vpp, cp=cp, dp=dp,
                                                              micro_batch_size=mbs, pipeline_layout=layout,
                                                              pp_schedule=schedule, **opts, **self._base())
                                        if c is not None and self._quick_valid(c):
                                            yield c

    def homogeneous_candidates(self, group):
        """Every fitting candidate on ``group`` alone (with its memory)."""
        for c in self.homogeneous_bases(group):
            yield from self._fitting(c, [group] * c.pp)

    def compute_bound(self, c: Candidate, stage_groups, fill: bool = True) -> float:
        """A lower bound on the step of ``c`` and of every candidate that differs from it only in sharding,
        shard groups, overlap flags or recompute (each of which only adds time to the stages' forwards and
        backwards): the busiest rank's compute at ZeRO-0 without recompute, after the pipeline's fill
        (``fill=False``: without it, a per-micro-batch rate), memoised over those keys."""
        base = c.with_(sharding="none", dp_shard=None, recompute="none", recompute_layers=None,
                       overlap_grad_reduce=False, overlap_param_gather=False, reshard_after_forward=False)
        key = (base, tuple(g.name for g in stage_groups))
        if key not in self._bounds:
            times = self.times(base, stage_groups)
            self._bounds[key] = (times.lower_bound(c.pp), times.busiest())
        return self._bounds[key][0 if fill else 1]

    def _quick_valid(self, c: Candidate) -> bool:
        """The rules of validate() beyond the parallel layout's own (checked when the candidate was made):
        the model's and the batch's, in arithmetic (validate() itself runs on the plans kept); stages of
        different widths: those of each width."""
        if c.stage_widths is not None:
            return all(self._quick_valid(w) for w in c.widths())
        layout = c.parallel
        s = self.shape
        if c.cp > 1 and c.cp_comm == "a2a" and (s.heads // c.tp) % c.cp:
            return False
        if s.seq % layout.sequence_multiple(c.sequence_parallel):
            return False
        if c.sharding == "none" and layout.shard_size != layout.dp_cp:
            return False
        if self.gbs % (c.micro_batch_size * c.dp):
            return False
        m = layout.microbatches(self.gbs, c.micro_batch_size)
        return layout.schedule.microbatch_rule(c.pp, c.vpp).error(m) is None

    def best(self, scored, top: int, plans=None) -> list:
        """Branch and bound: time candidates in order of their lower bound until none can enter the top
        (``plans``: the top so far, extended)."""
        scored.sort(key=lambda x: x[0])
        plans = list(plans or [])
        for bound, c, groups, times in scored:
            if len(plans) >= top and bound >= plans[-1].prediction.step_time_s:
                break
            if plans and self.out_of_time():
                break
            pred = predict(self.model, c, self.gbs, groups, times=times, memory=self.memory(c))
            if len(plans) >= top and pred.step_time_s >= plans[-1].prediction.step_time_s:
                continue
            if not self._validated(c):
                continue
            plans.append(Plan(candidate=c, stage_groups=tuple(groups), prediction=pred))
            plans.sort(key=lambda p: p.prediction.step_time_s)
            del plans[top:]
        return plans

    def _validated(self, c: Candidate) -> bool:
        """The training config's validate() accepts ``c`` (stages of different widths in their per-stage
        ``parallel.pipeline_layout``: the executor's own rules for them, e.g. no MoE, apply)."""
        if self.validate_fn is None:
            return True
        message = self.validate_fn(c)
        if message:
            self.rejected.append((c, message))
        return not message

    def plan_homogeneous(self, group, top: int = 5) -> list:
        """The best plans on ``group`` alone. Layouts are weighed in order of their compute bound
        (:meth:`compute_bound`, no memory estimate needed) and only those that can still enter the top
        ``top`` are checked against the memory (the estimator: most of the search's time) and timed."""
        bases = []
        for c in self.homogeneous_bases(group):
            bases.append((self.compute_bound(c, [group] * c.pp), len(bases), c))
            if self.out_of_time():
                break
        bases.sort(key=lambda x: x[:2])
        plans = []
        for bound, _, base in bases:
            if len(plans) >= top and bound >= plans[-1].prediction.step_time_s:
                break
            if plans and self.out_of_time():
                break
            groups = [group] * base.pp
            scored = []
            for c in self._fitting(base, groups):
                times = self.times(c, groups)
                scored.append((times.lower_bound(c.pp), c, groups, times))
            plans = self.best(scored, top, plans)
        return plans

    # --- heterogeneous (hetero.py) ----------------------------------------------------------
    def plan_heterogeneous(self, top: int = 5, ceiling: float = float("inf")) -> list:
        from megand.tools.planner.hetero import plan_heterogeneous

        return plan_heterogeneous(self, top, ceiling)

    # --- everything ----------------------------------------------------------------------------
    def plan(self, top: int = 5) -> list:
        """The ``top`` plans, best first: each group alone, then on a heterogeneous cluster pipelines over
        the groups (hetero.py) and replicas of different speeds (shares.py). With a time budget each phase
        stops when it is spent (:attr:`cut`), keeping the best plans found so far."""
        from megand.tools.planner.shares import plan_shares

        plans, alone = [], {}
        # pinned uneven shares: only replicas on several groups can run them
        shares_only = is_uneven(self.pinned.get("parallel.dp_microbatches"))
        phases = len(self.cluster.groups) + 2 * self.cluster.heterogeneous
        for group in self.cluster.groups:
            self._start_phase(phases)
            phases -= 1
            mine = [] if shares_only else self.plan_homogeneous(group, top)
            alone[group.name] = max((p.prediction.tokens_per_s for p in mine), default=0.0)
            plans += mine
        if self.cluster.heterogeneous:
            total = sum(alone.values())
            self._start_phase(2)
            # a later phase's plan enters the top only if faster than the top-th so far (an equal one sorts after)
            hetero = [] if shares_only else self.plan_heterogeneous(top, _ceiling(plans, top))
            for p in hetero:
                p.hetero_ratio = p.prediction.tokens_per_s / total if total else None
                p.alone_tokens_per_s = dict(alone)
            self._start_phase(1)
            plans += hetero
            plans += plan_shares(self, top, alone, _ceiling(plans, top))
        plans.sort(key=lambda p: p.prediction.step_time_s)
        if not plans:
            raise PlanError(self.why_impossible())
        return plans[:top]

    def why_impossible(self) -> str:
        if self.rejected:
            c, message = self.rejected[0]
            return f"every layout that fits was refused by the config's validate(), e.g.: {message}"
        if self.validate_fn is not None and self.pinned:  # the pins alone may break a rule of validate()
            p = self.pinned
            try:
                pinned = Candidate.of(**{**self._base(), "dp": 1, **{
                    field: p[key] for key, field in (("parallel.tp", "tp"), ("parallel.pp", "pp"), ("parallel.cp", "cp"),
                                                     ("parallel.vpp", "vpp"), ("train.micro_batch_size", "micro_batch_size"),
                                                     ("parallel.sequence_parallel", "sequence_parallel"),
                                                     ("parallel.cp_comm", "cp_comm")) if key in p}})
                message = self.validate_fn(pinned)
            except LayoutError as e:  # the parallel layout's own rules (validate() reports the same line)
                message = str(e)
            if message and "global_batch_size" not in message:
                return f"the pinned keys break a rule of the config: {message}"
        needed = self.smallest_fit()
        have = ", ".join(f"{g.name}: {g.devices} x {g.memory_gib:g} GiB" for g in self.cluster.groups)
        pins = " ".join(f"{k}={override_value(v)}" for k, v in sorted(self.pinned.items()))
        if needed is None:
            return (f"no layout fits: even {self.shape.layers}-stage pipelines with tp, ZeRO-3 and full recompute "
                    f"exceed the device memory ({have}){' with ' + pins if pins else ''}")
        return (f"no layout fits the cluster ({have}){' with ' + pins if pins else ''}: the smallest layout that fits "
                f"needs {needed[0]} devices of {needed[1]:g} GiB ({needed[2]})")

    def smallest_fit(self):
        """(devices, memory, layout) of the smallest layout that fits the largest-memory group's devices."""
        g = max(self.cluster.groups, key=lambda g: g.memory_gib)
        best = None
        tps = self.tp_domain(g.devices_per_node) or [1]
        for tp in tps:
            for pp in self._dom("parallel.pp", range(1, self.shape.layers + 1)):
                for dp in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
                    if best is not None and tp * pp * dp >= best[0]:
                        break
                    layouts = self.layouts(pp, None)
                    if not layouts:
                        continue
                    c = Candidate.of(tp=tp, pp=pp, dp=dp, sequence_parallel=tp > 1, micro_batch_size=1,
                                  sharding="optim_grads_params" if dp > 1 else "none", recompute="full",
                                  pipeline_layout=layouts[0], **self._base())
                    mem = stage_memory_gib(self.model, c, max(pp, 1))
                    if max(mem) <= g.memory_gib:
                        best = (tp * pp * dp, g.memory_gib, f"tp={tp} pp={pp} dp={dp}, ZeRO-3, full recompute")
                        break
        return best


def _ceiling(plans, top: int) -> float:
    """The step a new plan must beat to enter the best ``top`` of ``plans`` (inf while fewer)."""
    steps = sorted(p.prediction.step_time_s for p in plans)
    return steps[top - 1] if len(steps) >= top else float("inf")


def candidate_from_config(cfg, world_size: int) -> Candidate:
    """The layout a composed training config describes, for ``world_size`` ranks (``parallel.dp: null``
    takes what is left), to predict a given run (``predict_config``)."""
    p, t, o = cfg.parallel, cfg.train, cfg.optim
    return Candidate(parallel=planned_layout(p, world_size), sequence_parallel=bool(p.sequence_parallel),
                     sharding=o.sharding, micro_batch_size=t.micro_batch_size,
                     recompute=t.recompute, cp_comm=p.cp_comm, precision=t.precision,
                     recompute_layers=tuple(t.recompute_layers) if t.get("recompute_layers") is not None else None,
                     pipeline_layout=tuple(p.pipeline_layout) if p.pipeline_layout else None,
                     overlap_grad_reduce=bool(o.overlap_grad_reduce), overlap_param_gather=bool(o.overlap_param_gather),
                     reshard_after_forward=bool(o.reshard_after_forward), bucket_size=int(o.bucket_size),
                     fp8=t.get("fp8"), fp8_bf16_layers=int(t.get("fp8_bf16_layers", 1)))


def predict_config(cfg, cluster, world_size: int):
    """The prediction for the run ``cfg`` describes on ``cluster`` (its stages on the groups in order of
    decreasing memory, as many stages per group as fit): the planner's cost model for a pinned run."""
    from omegaconf import OmegaConf

    c = candidate_from_config(cfg, world_size)
    groups = sorted(cluster.groups, key=lambda g: -g.memory_gib)
    stage_groups = []
    for g in groups:
        stage_groups += [g] * min(g.devices // c.stage_size, c.pp - len(stage_groups))
    if len(stage_groups) < c.pp:
        raise PlanError(f"{c.pp} pipeline stages of {c.stage_size} ranks do not fit the cluster's "
                        f"{cluster.devices} devices")
    model = OmegaConf.to_container(cfg.model, resolve=True)
    return predict(model, c, int(cfg.train.global_batch_size), stage_groups)
