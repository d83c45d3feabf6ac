"""The predicted step time and memory of one layout on its devices.

Per virtual stage and micro-batch, a forward and a backward time:

- compute: every GEMM of the stage's layers at its real shape on this rank (tokens of one micro-batch
  on this cp rank x the tp shard of the weight), at the profile's peak times the efficiency measured
  for that shape (profile.gemm_efficiency); the backward is two such products per forward product
  (input and weight gradients); recomputation adds what it runs again (``full``: the layers' forward,
  ``selective``: the attention core); the output layer on the last stage;
- memory-bound work (norms, residual adds, activation function, RoPE, the vocab-parallel loss) as bytes
  over the profile's ``memory_gbps``;
- tensor-parallel collectives (two all-reduces per layer and direction, or with sequence parallelism an
  all-gather and a reduce-scatter each: the same bytes), never overlapped in megand;
- context-parallel attention: the ring (p2p) overlaps each K/V transfer with a block of attention, so
  only what exceeds the attention time shows; all_gather and a2a (Ulysses) are not overlapped;
- ZeRO-2 reduce-scatters per micro-batch and ZeRO-3 parameter gathers, prefetched under the module's
  compute: only the excess over it shows (at least one bucket);
- the profile's fixed overheads (per layer and micro-batch, per micro-batch).

The pipeline (simulate.py) replays the candidate's schedule (``parallel.pp_schedule``, stages placed
where that schedule puts them; a split backward's ``W`` is the layers' weight-gradient products) on
those times with the p2p time of each stage boundary; then each rank's gradient reduction over dp x cp (all-reduce, or reduce-scatter plus the
replica all-reduce under hybrid sharding) hides under its last backwards when
``optim.overlap_grad_reduce`` is on; the optimizer step is memory-bound; the parameter all-gather of
``optim``/``optim_grads`` hides under the next forward with ``optim.overlap_param_gather``. The step
is the slowest rank's. Memory per stage is megand/tools/estimate_memory.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from megand.models.flops import Shape, flops_per_iteration, fp8_flops_fraction, layer_params
from megand.core.optimizer.registry import optimizer_for, record
from megand.core.tensor_parallel.fp8_recipes import fp8_recipe
from megand.tools.estimate_memory import Layout, estimate_memory, matrix_step_cost, stage_params, stage_params_by_role
from megand.tools.planner.layout import Candidate, place, spanned_links
from megand.tools.planner.profile import collective_time, gemm_efficiency, gemm_time
from megand.tools.planner.simulate import simulate
from megand.training.peak import mixed_peak

GIB = 2 ** 30


@dataclass
class Prediction:
    step_time_s: float
    tokens_per_s: float
    tflops_per_device: float      # hardware FLOP/s per device (recomputation included, as Megatron counts)
    mfu: float                    # model FLOPs (no recomputation) over the devices' summed peak
    bubble_fraction: float
    mem_peak_gib: list            # per pipeline stage
    memory_gib: list              # per pipeline stage: the device memory
    parts: dict = field(default_factory=dict)  # seconds of the step's pieces, for people

    @property
    def fits(self) -> bool:
        return all(m <= cap for m, cap in zip(self.mem_peak_gib, self.memory_gib))

    def as_dict(self) -> dict:
        return {"step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
                "tflops_per_device": self.tflops_per_device, "mfu": self.mfu,
                "bubble_fraction": self.bubble_fraction, "mem_peak_gib": self.mem_peak_gib}


def memory_layout(c: Candidate, num_microbatches: int) -> Layout:
    """The estimator's layout for a candidate (16-bit runs use SDPA's flash kernel: no s x s stored); with
    stages of different widths, their widths (the estimator counts each stage at its own)."""
    parallel = c.parallel if c.stage_widths is None else _stage_widths(c.parallel, c.stage_widths)
    return Layout(parallel=parallel, sequence_parallel=c.sequence_parallel,
                  sharding=c.sharding, bucket_size=c.bucket_size,
                  reshard_after_forward=c.reshard_after_forward, precision=c.precision, recompute=c.recompute,
                  recompute_layers=c.recompute_layers,
                  micro_batch_size=c.micro_batch_size, num_microbatches=num_microbatches,
                  fused_attention=c.fused, pipeline_layout=c.pipeline_layout, optimizer=c.optimizer)


@lru_cache(maxsize=4096)
def _stage_widths(parallel, widths):
    """``parallel`` with each pipeline rank at its ``(tp, sequence_parallel)`` of ``widths``."""
    return parallel.with_(stage_tp=tuple(tp for tp, _ in widths), stage_sp=tuple(sp for _, sp in widths))


def stage_memory_gib(model: dict, c: Candidate, num_microbatches: int) -> list:
    """Peak GiB of each pipeline stage's most loaded rank."""
    est = estimate_memory(model, memory_layout(c, num_microbatches), stages=range(c.pp))
    return [st.total_bytes / GIB for st in est.stages]


def recomputed_per_stage(layers: list, c: Candidate) -> list:
    """Layers that recompute in each virtual stage (``c.recompute_layers``, or all of them)."""
    if c.recompute == "none":
        return [0] * len(layers)
    return list(layers) if c.recompute_layers is None else list(c.recompute_layers)


def virtual_stage_layers(num_layers: int, c: Candidate) -> list:
    stages = c.pp * (c.vpp or 1)
    if c.pipeline_layout is not None:
        return list(c.pipeline_layout)
    return [num_layers / stages] * stages


def _elem(precision: str) -> int:
    return 4 if precision == "fp32" else 2


@dataclass
class LayerTimes:
    """One transformer layer, one micro-batch, on one rank: seconds by kind."""

    gemm_fwd: float
    attn_fwd: float        # the attention core's products (part of what recomputation reruns)
    mem_fwd: float
    tp_fwd: float
    cp_fwd: float
    cp_bwd: float
    overhead: float

    def forward(self) -> float:
        return self.gemm_fwd + self.attn_fwd + self.mem_fwd + self.tp_fwd + self.cp_fwd + self.overhead / 3

    def backward(self, recompute: str) -> float:
        t = 2 * (self.gemm_fwd + self.attn_fwd + self.mem_fwd) + self.tp_fwd + self.cp_bwd + 2 * self.overhead / 3
        if recompute == "full":
            t += self.gemm_fwd + self.attn_fwd + self.mem_fwd + self.tp_fwd + self.cp_fwd
        elif recompute == "selective":
            t += self.attn_fwd
        return t


def layer_times(shape: Shape, c: Candidate, profile, tp_link: str, cp_link: str, fp8: bool = False) -> LayerTimes:
    """``fp8``: a layer whose linear GEMMs run in FP8 (``train.fp8``), at the profile's FP8 peak, its
    sequence-parallel all-gathers moving FP8 bytes."""
    h, q, f, kv, s, e = shape.hidden, shape.q_dim, shape.ffn, shape.kv_dim, shape.seq, _elem(c.precision)
    tp, cp = c.tp, c.cp
    tokens = c.micro_batch_size * s / cp
    mlp_in = (2 if shape.swiglu else 1) * f
    gemm = (gemm_time(profile, tokens, (q + 2 * kv) / tp, h, fp8=fp8) + gemm_time(profile, tokens, h, q / tp, fp8=fp8)
            + gemm_time(profile, tokens, mlp_in / tp, h, fp8=fp8) + gemm_time(profile, tokens, h, f / tp, fp8=fp8))
    # attention core: scores and context, 4*s*q FLOPs per token over the local heads (flops.py's count),
    # run as batched [s/cp, d] x [d, s] products
    heads = shape.heads / tp
    attn_flops = 4.0 * tokens * s * q / tp
    unit = gemm_time(profile, s / cp, s, shape.head_dim)  # one head's scores product
    unit_flops = 2.0 * (s / cp) * s * shape.head_dim
    attn = attn_flops * unit / unit_flops if unit_flops else 0.0
    split = tp if c.sequence_parallel and tp > 1 else 1
    act = (3 if shape.swiglu else 2) * f / tp
    rope = 4 * (q + kv) / tp if not shape.learned_positions else 0
    mem_bytes = e * tokens * ((4 * h + 6 * h) / split + act + rope)  # norms r/w, residual adds, activation, rope
    if not c.fused:  # s x s scores written, softmax read and written, probabilities read by the context product
        mem_bytes += 4 * e * tokens * heads * s
    mem = mem_bytes / (profile.memory_gbps * 1e9)
    act_bytes = tokens * h * e  # one full activation of the micro-batch on this cp rank
    if tp > 1:
        if c.sequence_parallel:
            gather_bytes = act_bytes / e if fp8 else act_bytes  # FP8: one byte per element
            tp_fwd = 2 * (collective_time(profile, "all_gather", gather_bytes, tp, tp_link)
                          + collective_time(profile, "reduce_scatter", act_bytes, tp, tp_link))
        else:
            tp_fwd = 2 * collective_time(profile, "all_reduce", act_bytes, tp, tp_link)
    else:
        tp_fwd = 0.0
    cp_fwd = cp_bwd = 0.0
    if cp > 1:
        kv_bytes = 2 * tokens * kv / tp * e  # this rank's K and V
        if c.cp_comm == "p2p":  # ring: cp-1 transfers, each under a block of attention
            ring = (cp - 1) * collective_time(profile, "p2p", kv_bytes, 2, cp_link)
            cp_fwd = max(0.0, ring - attn)
            cp_bwd = max(0.0, 2 * ring - 2 * attn)  # K/V again and their gradients
        elif c.cp_comm == "all_gather":
            cp_fwd = collective_time(profile, "all_gather", cp * kv_bytes, cp, cp_link)
            cp_bwd = collective_time(profile, "reduce_scatter", cp * kv_bytes, cp, cp_link) + cp_fwd
        else:  # a2a: q, k, v in and the context out, re-sharded between heads and sequence
            moved = tokens * (2 * h + 2 * kv) / tp * e
            cp_fwd = collective_time(profile, "all_to_all", moved, cp, cp_link) + 3 * profile.collectives[cp_link]["all_to_all"]["alpha_s"]
            cp_bwd = cp_fwd
    overhead = profile.overhead_s.get("per_layer_step", 0.0)
    return LayerTimes(gemm_fwd=gemm, attn_fwd=attn, mem_fwd=mem, tp_fwd=tp_fwd, cp_fwd=cp_fwd, cp_bwd=cp_bwd,
                      overhead=overhead)


def _edge_times(shape: Shape, c: Candidate, profile, tp_link: str, first: bool, last: bool):
    """Forward and backward seconds of the embedding (first stage) and output layer + loss (last stage)."""
    tokens = c.micro_batch_size * shape.seq / c.cp
    e, h, tp = _elem(c.precision), shape.hidden, c.tp
    fwd = bwd = 0.0
    act_bytes = tokens * h * e
    if first:
        fwd += 2 * act_bytes / (profile.memory_gbps * 1e9)
        bwd += 2 * act_bytes / (profile.memory_gbps * 1e9)
        if tp > 1:  # vocab-parallel embedding: all-reduce (or reduce-scatter under sp) of its output
            fwd += collective_time(profile, "all_reduce", act_bytes, tp, tp_link)
    if last:
        logits = gemm_time(profile, tokens, shape.vocab / tp, h)
        loss_bytes = 4 * tokens * shape.vocab / tp * 3  # fp32 logits: softmax read/write, gradient
        fwd += logits + loss_bytes / 2 / (profile.memory_gbps * 1e9)
        bwd += 2 * logits + loss_bytes / 2 / (profile.memory_gbps * 1e9)
        if tp > 1:
            bwd += collective_time(profile, "all_reduce", act_bytes, tp, tp_link)
    return fwd, bwd


_LINKS = {}


def _placement_and_links(c: Candidate, stage_groups: tuple):
    """Placement and links depend only on the grid, the order, the shard groups and the stage groups:
    memoised, since thousands of candidates share a grid (and a grid may have tens of thousands of ranks)."""
    key = (c.tp, c.cp, c.dp, c.pp, c.order, c.dp_shard, tuple((g.name, g.devices_per_node) for g in stage_groups))
    if key not in _LINKS:
        if len(_LINKS) > 512:
            _LINKS.clear()
        placement = place(c, stage_groups)
        _LINKS[key] = (placement, spanned_links(c, placement))
    return _LINKS[key]


@dataclass
class StageTimes:
    """Per virtual stage: one micro-batch's forward and backward seconds, and the part of the backward
    that is weight gradients (a zero-bubble schedule's ``W``); per boundary: p2p seconds."""

    forward: list
    backward: list
    p2p: list
    microbatches: int
    links: dict
    placement: object
    weight_grad: list = None
    rank_stages: list = None  # per pipeline rank: its virtual stages (the schedule's placement)

    def busiest(self) -> float:
        """The busiest rank's compute over the step's micro-batches."""
        m = self.microbatches
        return max(m * sum(self.forward[s] + self.backward[s] for s in stages) for stages in self.rank_stages)

    def lower_bound(self, pp: int) -> float:
        """No schedule can finish the step's pipeline faster: a rank's first forward waits for the first
        micro-batch's forwards on every virtual stage before its own first one (the pipeline's fill), then
        the rank computes all of its work."""
        m = self.microbatches
        return max(sum(self.forward[:min(stages)]) + m * sum(self.forward[s] + self.backward[s] for s in stages)
                   for stages in self.rank_stages)


def rank_virtual_stages(c: Candidate) -> list:
    """Per pipeline rank, the virtual stages it holds under its schedule's placement (interleaved:
    ``r, r + pp, ...``; a V: ``r`` and ``2·pp - 1 - r``)."""
    return _rank_stages(c.parallel)


@lru_cache(maxsize=4096)
def _rank_stages(parallel) -> tuple:
    """:func:`rank_virtual_stages` once per layout (tuples: the answer is shared)."""
    placement = parallel.placement
    return tuple(tuple(placement.stages_of(r)) for r in range(parallel.pp))


def mixed_stage_times(model: dict, c: Candidate, global_batch_size: int, stage_groups, cache=None) -> StageTimes:
    """Stages of different widths (``c.stage_widths``): each virtual stage's times, links and groups are
    those of the uniform layout at its rank's width (its groups sit on its own group's nodes in the same
    place); a boundary between widths costs the slower side's send (the narrower side sends more per rank)."""
    by_width = {w: stage_times(model, c.of_rank(c.stage_widths.index(w)), global_batch_size, stage_groups, cache)
                for w in dict.fromkeys(c.stage_widths)}
    ranks = rank_virtual_stages(c)
    width_of_stage = {s: c.stage_widths[r] for r, stages in enumerate(ranks) for s in stages}
    of = [by_width[width_of_stage[s]] for s in range(len(width_of_stage))]
    first = next(iter(by_width.values()))
    links = {kind: [by_width[c.stage_widths[r]].links[kind][r] for r in range(c.pp)]
             for kind in first.links if kind != "pp"}
    links["pp"] = [max(by_width[c.stage_widths[r]].links["pp"][r], by_width[c.stage_widths[r + 1]].links["pp"][r],
                       key=lambda link: link == "inter_node") for r in range(c.pp - 1)]
    return StageTimes(forward=[t.forward[s] for s, t in enumerate(of)], backward=[t.backward[s] for s, t in enumerate(of)],
                      p2p=[max(of[s].p2p[s], of[s + 1].p2p[s]) for s in range(len(of) - 1)],
                      microbatches=first.microbatches, links=links, placement=place(c, stage_groups),
                      weight_grad=[t.weight_grad[s] for s, t in enumerate(of)], rank_stages=ranks)


_ZERO_2_3 = ("optim_grads", "optim_grads_params")


def times_key(c: Candidate) -> tuple:
    """What :func:`stage_times` reads of ``c``: candidates alike in these have the same stage times (the
    overlap flags and the optimizer do not enter them; the sharding level, its bucket and resharding only
    where ZeRO-2/3 adds its collectives to the stages)."""
    zero = c.sharding if c.sharding in _ZERO_2_3 else "none"
    return (c.parallel, c.sequence_parallel, c.micro_batch_size, c.precision, c.fused_attention, c.recompute,
            c.recompute_layers, c.pipeline_layout, c.fp8, c.fp8_bf16_layers, c.cp_comm, zero,
            c.bucket_size if zero != "none" else None,
            c.reshard_after_forward if zero == "optim_grads_params" else None, c.stage_widths)


def stage_times(model: dict, c: Candidate, global_batch_size: int, stage_groups, cache=None) -> StageTimes:
    """``cache``: a dict memoising the answers for one ``model``, batch and cluster (the planner's: its search
    asks for the same stages' times many times over, under candidates that differ only in keys the times do
    not read, :func:`times_key`); the answers are shared, not to be changed."""
    if cache is not None:
        key = (times_key(c), tuple(g.name for g in stage_groups))
        times = cache.get(key)
        if times is None:
            times = cache[key] = (mixed_stage_times(model, c, global_batch_size, stage_groups, cache)
                                  if c.stage_widths is not None else _stage_times(model, c, global_batch_size, stage_groups))
        return times
    if c.stage_widths is not None:
        return mixed_stage_times(model, c, global_batch_size, stage_groups)
    return _stage_times(model, c, global_batch_size, stage_groups)


def _stage_times(model: dict, c: Candidate, global_batch_size: int, stage_groups) -> StageTimes:
    shape = Shape.from_config(model)
    m = c.parallel.microbatches(global_batch_size, c.micro_batch_size)
    stages = c.pp * (c.vpp or 1)
    placement, links = _placement_and_links(c, tuple(stage_groups))
    where = c.parallel.placement.location  # virtual stage -> (rank, chunk)
    layers = virtual_stage_layers(shape.layers, c)
    recomputed = recomputed_per_stage(layers, c)
    elem = _elem(c.precision)
    forward, backward, weight_grad, per_group, per_stage = [], [], [], {}, {}
    for s in range(stages):
        r, chunk = where(s)
        g = stage_groups[r]
        links_r = (links["tp"][r], links["cp"][r], links["dp_shard"][r])
        # virtual stages alike in group, links, layers and position cost the same: computed once
        in_fp8 = fp8_layers_in(shape.layers, c, sum(layers[:s]), layers[s])
        key = (g.name, links_r, layers[s], recomputed[s], s == 0, s == stages - 1, chunk == 0, in_fp8)
        if key not in per_stage:
            prof = g.profile
            for fp8 in {False, bool(in_fp8)}:
                if (g.name, links_r, fp8) not in per_group:
                    per_group[(g.name, links_r, fp8)] = layer_times(shape, c, prof, links_r[0], links_r[1], fp8)
            lt, lt8 = per_group[(g.name, links_r, False)], per_group[(g.name, links_r, bool(in_fp8))]
            f = (layers[s] - in_fp8) * lt.forward() + in_fp8 * lt8.forward()
            # the layers that recompute re-run their forward (or attention core) in backward, the others
            # not; the recomputing share taken alike among the stage's FP8 and bf16 layers
            share = recomputed[s] / layers[s] if layers[s] else 0.0

            def layer_backward(times):
                return (1 - share) * times.backward("none") + share * times.backward(c.recompute)

            b = (layers[s] - in_fp8) * layer_backward(lt) + in_fp8 * layer_backward(lt8)
            ef, eb = _edge_times(shape, c, prof, links_r[0], s == 0, s == stages - 1)
            f, b = f + ef, b + eb
            if chunk == 0:  # the per-micro-batch fixed cost, once per rank (on its first chunk)
                f += prof.overhead_s.get("per_microbatch", 0.0)
            # the weight-gradient products (dW = dy^T x: the forward's GEMM FLOPs; the attention core has
            # no weights), the output layer's on the last stage: what a split backward defers to W
            w = (layers[s] - in_fp8) * lt.gemm_fwd + in_fp8 * lt8.gemm_fwd
            if s == stages - 1:
                w += gemm_time(prof, c.micro_batch_size * shape.seq / c.cp, shape.vocab / c.tp, shape.hidden)
            per_stage[key] = _add_sharded_comm(shape, c, prof, links, r, layers[s], f, b, elem, in_fp8) + (w,)
        f, b, w = per_stage[key]
        forward.append(f)
        backward.append(b)
        weight_grad.append(min(w, b))
    p2p = []
    tokens = c.micro_batch_size * shape.seq / c.cp
    act_bytes = tokens * shape.hidden * elem / (c.tp if c.sequence_parallel and c.tp > 1 else 1)
    for s in range(stages - 1):
        r, nxt = where(s)[0], where(s + 1)[0]
        if r == nxt:  # a V's turn: both chunks on one rank, nothing sent
            p2p.append(0.0)
            continue
        link = links["pp"][min(r, nxt)] if abs(nxt - r) == 1 else _wrap_link(links, c)
        p2p.append(max(collective_time(stage_groups[r].profile, "p2p", act_bytes, 2, link),
                       collective_time(stage_groups[nxt].profile, "p2p", act_bytes, 2, link)))
    return StageTimes(forward=forward, backward=backward, p2p=p2p, microbatches=m, links=links, placement=placement,
                      weight_grad=weight_grad, rank_stages=rank_virtual_stages(c))


def predict(model: dict, c: Candidate, global_batch_size: int, stage_groups, times: StageTimes | None = None,
            memory: list | None = None) -> Prediction:
    """The step of candidate ``c`` with pipeline stage r on cluster group ``stage_groups[r]``."""
    times = times or stage_times(model, c, global_batch_size, stage_groups)
    m, links, forward = times.microbatches, times.links, times.forward
    timeline = simulate(c.pp, c.vpp, m, times.forward, times.backward, times.p2p, schedule=c.pp_schedule,
                        weight_grad=times.weight_grad)
    ends, opt_times = [], []
    for r in range(c.pp):
        prof = stage_groups[r].profile
        first_forward = sum(forward[s] for s in times.rank_stages[r])
        grad_exposed, param_exposed, opt = _data_parallel_tail(model, c.of_rank(r), prof, links, r, timeline,
                                                               first_forward, m)
        ends.append(timeline.finish[r] + grad_exposed)
        opt_times.append(opt + param_exposed)
    world = c.world_size
    norm_sync = collective_time(stage_groups[0].profile, "all_reduce", 8, world,
                                "inter_node" if len(times.placement.nodes) > 1 else "intra_node")
    per_step = max(g.profile.overhead_s.get("per_step", 0.0) for g in stage_groups)
    step = max(ends) + max(opt_times) + norm_sync + per_step
    flops = flops_per_iteration(model, global_batch_size, c.recompute, recomputed_layers=recomputed_ids(model, c))
    # FP8 runs: the peak of the step's mix of FP8 and bf16 FLOPs (as the training log's MFU)
    layers = Shape.from_config(model).layers
    fraction = fp8_flops_fraction(model, round(fp8_layers_in(layers, c, 0, layers)), c.tp) if c.fp8 else 0.0
    peak_sum = sum(mixed_peak(g.profile.peak_tflops, g.profile.peak_fp8_tflops, fraction) * size
                   for g, size in zip(stage_groups, c.stage_sizes)) * 1e12
    mem = memory if memory is not None else stage_memory_gib(model, c, m)
    return Prediction(
        step_time_s=step, tokens_per_s=flops["tokens"] / step,
        tflops_per_device=flops["hardware_flops"] / step / world / 1e12,
        mfu=flops["model_flops"] / step / peak_sum, bubble_fraction=timeline.bubble_fraction,
        mem_peak_gib=mem, memory_gib=[g.memory_gib for g in stage_groups],
        parts={"pipeline_s": timeline.makespan, "grad_sync_exposed_s": max(ends) - timeline.makespan,
               "optimizer_s": max(opt_times), "microbatches": m,
               "forward_s": forward, "backward_s": times.backward})


def recomputed_ids(model: dict, c: Candidate):
    """The layer ids that recompute (None: all)."""
    if c.recompute_layers is None:
        return None
    from megand.core.pipeline_parallel.layout import recomputed_layer_ids

    sizes = [int(n) for n in virtual_stage_layers(Shape.from_config(model).layers, c)]
    return recomputed_layer_ids(sizes, list(c.recompute_layers))


def fp8_layers_in(num_layers: int, c: Candidate, first: float, count: float) -> float:
    """How many of the ``count`` layers from layer ``first`` run their GEMMs in FP8 (``train.fp8``: all but
    the first and last ``fp8_bf16_layers``); fractional with an even split of layers over stages."""
    if not c.fp8:
        return 0.0
    lo, hi = c.fp8_bf16_layers, num_layers - c.fp8_bf16_layers
    return max(0.0, min(first + count, hi) - max(first, lo))


def _wrap_link(links, c: Candidate) -> str:
    """Interleaving sends from the last rank back to the first between model chunks."""
    return "inter_node" if "inter_node" in links["pp"] else "intra_node"


def _dp_size(c: Candidate) -> int:
    return c.parallel.dp_cp


def _add_sharded_comm(shape: Shape, c: Candidate, prof, links, r: int, layers: float, f: float, b: float, elem,
                      in_fp8: float = 0.0):
    """ZeRO-2's per-micro-batch gradient reduce-scatter and ZeRO-3's parameter gathers, prefetched
    under the chunk's compute: only their excess (at least one bucket) adds to the chunk's time. The
    ``in_fp8`` layers' weights are gathered in FP8 (one byte) for forward, and for backward too under a
    one-scale recipe (its record's ``one_scale``, tensorwise; rowwise and MX gather the high-precision weight
    for it)."""
    d = c.dp_shard or _dp_size(c)
    if d <= 1 or c.sharding not in ("optim_grads", "optim_grads_params"):
        return f, b
    link = links["dp_shard"][r]
    params = layers * layer_params(shape).per_tp_rank(c.tp)
    bucket = min(1.0, c.bucket_size / max(params, 1.0))
    rs = collective_time(prof, "reduce_scatter", 4 * params, d, link)
    b_comm = rs
    f_comm = 0.0
    if c.sharding == "optim_grads_params":
        fp8_params = in_fp8 * layer_params(shape).per_tp_rank(c.tp)
        f_comm = collective_time(prof, "all_gather", elem * params - (elem - 1) * fp8_params, d, link)
        if c.reshard_after_forward:
            fp8_bwd = fp8_params if c.fp8 and fp8_recipe(c.fp8).one_scale else 0.0
            b_comm += collective_time(prof, "all_gather", elem * params - (elem - 1) * fp8_bwd, d, link)
    f += max(f_comm * bucket, f_comm - f)
    b += max(b_comm * bucket, b_comm - b)
    return f, b


def _data_parallel_tail(model, c: Candidate, prof, links, r: int, timeline, first_forward: float, m: int):
    """(exposed gradient reduction after the last backward, exposed parameter gather, optimizer seconds);
    ``first_forward``: rank ``r``'s forward of one micro-batch over all its chunks (the gather hides under it)."""
    layout = memory_layout(c, m)
    params = stage_params(model, layout, r)
    d = _dp_size(c)
    shard = c.dp_shard or d
    level = c.sharding if d > 1 else "none"
    # memory-bound: each role's main params times the bytes its optimizer's update moves per element
    moved = sum(n * optimizer_for(c.optimizer, role).update_bytes
                for role, n in stage_params_by_role(model, layout, r).items())
    opt = moved / (shard if level != "none" else 1) / (prof.memory_gbps * 1e9)
    if record(c.optimizer).matrix_flops is not None:  # whole matrices (Muon's Newton-Schulz) and moving the pieces
        work, h = matrix_step_cost(model, layout, r), Shape.from_config(model).hidden
        opt += work["flops"] / (prof.peak_tflops * 1e12 * gemm_efficiency(prof, h, h, h))
        local = work["bytes"] / 2  # fp32 layer matrices of this tp rank: reduced to and broadcast from owners
        opt += collective_time(prof, "all_reduce", local, shard if level != "none" else d, links["dp_shard"][r])
        opt += 2 * collective_time(prof, "all_gather", local * c.tp, c.tp, links["tp"][r])  # gather + scatter
    if d <= 1:
        return 0.0, 0.0, opt
    bucket = min(1.0, c.bucket_size / max(params, 1.0))
    grad_bytes = 4 * params
    if level == "none":
        reduce = collective_time(prof, "all_reduce", grad_bytes, d, links["dp_cp"][r])
    else:
        reduce = 0.0 if level in ("optim_grads", "optim_grads_params") else \
            collective_time(prof, "reduce_scatter", grad_bytes, shard, links["dp_shard"][r])
        if shard < d:  # hybrid sharding: the shard's gradient is all-reduced over the replicas
            reduce += collective_time(prof, "all_reduce", grad_bytes / shard, d // shard, links["dp_replica"][r])
    window = timeline.last_backward[r] if c.overlap_grad_reduce else 0.0
    grad_exposed = max(reduce * bucket, reduce - window) if c.overlap_grad_reduce else reduce
    param_exposed = 0.0
    if level in ("optim", "optim_grads"):
        gather = collective_time(prof, "all_gather", _elem(c.precision) * params, shard, links["dp_shard"][r])
        param_exposed = max(gather * bucket, gather - first_forward) if c.overlap_param_gather else gather
    return grad_exposed, param_exposed, opt
