"""Memory estimator: per-rank parameters, optimizer states and activations for a model and layout.

States (bytes per parameter held by the rank, Megatron's accounting):
    fp32:        param 4 + grad 4 + Adam m,v 8                                   = 16
    bf16/fp16:   param 2 + fp32 main grad 4 + fp32 main param 4 + Adam m,v 8     = 18
    sharding levels (``optim.sharding``) over the shard group of d ranks (dp·cp, or ``parallel.dp_shard``
    of it under hybrid sharding): ``optim`` (ZeRO-1, the distributed optimizer) shards the main params
    and Adam states: mixed 6 + 12/d, fp32 8 + 8/d; ``optim_grads`` (ZeRO-2) also the fp32 grads:
    mixed 2 + 16/d, fp32 4 + 12/d; ``optim_grads_params`` (ZeRO-3) everything: mixed 18/d, fp32 16/d,
    plus the buckets gathered while they are used (two buckets of parameters and of gradient scratch;
    with ``reshard_after_forward=false`` the stage's whole parameters between forward and backward).
    Adam's m and v are AdamW's states: the optimizer's record (``optim.name``) says how many fp32 states
    each parameter role keeps: Muon one for the layers' matrices (AdamW's two for the rest), Lion one
    everywhere (4 bytes less per parameter, before sharding).

Activations stored for the backward pass, per layer and micro-batch (Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models"). For GPT-2 shapes in 16-bit with
dropout the sum is their ``s·b·h·(34 + 5·a·s/h)``; here each term is written out so it adapts:

    per token, replicated over tp (divided by tp only with sequence parallelism):
        norm1 input e·h, QKV input e·h, norm2 input e·h, MLP input e·h,
        sandwich norms (Gemma): the two branch-output norms' inputs, 2·e·h more,
        two dropout masks 1·h each (only when hidden_dropout > 0)                   10·h for GPT-2
    per token, split over tp:
        Q and K  e·(q + kv), V  e·kv        (q = heads·head_dim, = h unless head_dim is set apart;
                                             GQA: kv = groups·head_dim; K/V assumed not expanded;
                                             model.v_norm: the value norm's input, e·kv more;
                                             a full layer of its own shape counts its own q and kv;
                                             values equal to the keys (model.global_k_eq_v): V is K's
                                             rows, not stored again; a layer reading an earlier layer's
                                             keys and values (model.num_kv_shared_layers) stores none;
                                             under full recompute the layers they read keep K and V
                                             (after their norms and RoPE, e·2·kv) until the backward)
        attention output-projection input e·q
        MLP: gelu  2·e·f (activation input, fc2 input) ; swiglu and geglu 3·e·f (gate, up, down input)
                                                                                    24·h for GPT-2
    attention core, split over tp, per token: a·s·(2e + 1) with attention dropout (softmax output,
        mask, dropout output), a·s·e without (the softmax output serves both)      5·a·s for GPT-2
``e`` is the activation element size (2 for bf16/fp16, 4 for fp32). With ``fused_attention``
(flash / memory-efficient kernels) the s×s probabilities are never stored: the core keeps one fp32
log-sum-exp per query and head (4·a bytes per token), which makes ``selective`` nearly free.
Per-layer input embeddings (``model.per_layer_input_size`` p, Gemma 4): each layer's gated branch keeps, per
token and replicated over tp (/tp with sequence parallelism), the gate's input and the branch norm's input
2·e·h and four p-wide tensors (gate output, its activation, the per-layer input, up's input) 4·e·p; every stage
holds the projected word embedding of all L layers (e·L·p per token, received over the pipeline link, or made
on the first stage, which also keeps the norm's input: 2·e·L·p) per micro-batch in flight. Weights: each layer's
table ``[V, p]`` is split over tp by vocab rows on its own stage (an embedding for the optimizer), gate and up
replicated; the projection ``[L·p, h]`` on the first stage, replicated. Gemma 4's MoE block beside the MLP
(``model.moe_beside_mlp``) keeps the dense MLP's terms too, and its three norms' inputs and the router norm's
output, 4·e·h replicated.
A Gated DeltaNet layer (``model.layer_types``) stores its token mixer's terms instead of attention's (see
:func:`linear_attention_bytes`: its projections, its fp32 chunked core with the C×C chunk matrices, and the
recurrent state at each chunk boundary); ``selective`` drops its core.

DeepSeek Sparse Attention (``model.dsa_index_topk``, see :func:`sparse_attention_bytes`) replaces the attention
core's term by its path's (megand/core/transformer/dsa_sparse.py chooses the dense mask or the top-k gather
by the sequence and k) and adds its lightning indexer's (replicated over tp) and, under cp, the whole
sequence's gathered keys and values.

Recompute: ``selective`` drops the attention-core term (Megatron recomputes core attention);
``full`` stores only each layer's input (e·h per token, /tp with sequence parallelism) and adds one
layer's full activations for one micro-batch as the working set of the recomputation in backward.
With ``recompute_layers`` (``train.recompute_layers``) only the first n_j layers of virtual stage j
recompute; the stage's other layers store everything (each layer counted with its own mode).

Context parallelism divides the tokens of a rank by cp; the attention core is counted with each local
query seeing all s keys (all-gather semantics, an upper bound for ring attention).

Pipeline: 1F1B keeps min(pp - r, m) micro-batches in flight on stage r (stage 0 is the most loaded);
the interleaved schedule with v virtual stages keeps min(2·(pp - r - 1) + (v - 1)·pp + 1, m·v) model
chunks of L/(pp·v) layers in flight, i.e. Megatron's factor (1 + (pp - 1)/(pp·v)) on stage 0 (with
m = pp it runs every forward first: m·v chunks on every stage). Both are counted on the action list the
executor runs (megand/core/pipeline_parallel/actions.py), not from these formulas. An uneven
``parallel.pipeline_layout`` counts each stage's own layers (its chunks at their mean size).

Stages of different widths (the per-stage ``parallel.pipeline_layout``, ``ParallelLayout.stage_tp``): each stage is
counted at its own width (:meth:`Layout.at_stage`: every term above with its tp and sequence parallelism, the
embedding on the first stage and the output layer on the last at theirs, the micro-batches in flight of the
common schedule), plus what the hand-off between widths holds (:func:`hand_off_bytes`): the outputs a stage
sent to another width, kept until their backward (a one-width pipeline frees each once sent), and on a
sequence-parallel sender one gathered whole message.

Mixture of Experts (``model.num_experts``; layer i is MoE when i % moe_layer_freq == 0):
    weights: the routed experts ``[E, ...]`` are split over ``ep`` (whole experts) and ``etp`` (expert
        tensor parallelism, 1 or tp); they are replicated over the expert-data-parallel group of
        edp = tp·dp·cp / (ep·etp) ranks (Megatron's expert layout; edp = dp·cp/ep when etp = tp), which
        is the group the sharding levels shard their states over (dense weights: dp·cp as above).
        The router, the shared-expert gate and the norms are replicated; the shared experts are a
        tp-parallel MLP of width moe_shared_experts·f_e.
    activations of a MoE layer, instead of the dense MLP's, per micro-batch on one rank (routing assumed
        balanced; a capacity factor c > 1 scales the routed part by c, its bound):
        router logits and scores in fp32, 8·E bytes per token (/tp with sequence parallelism);
        the dispatched tokens: A = T·k assignments (T = micro·s/cp tokens; / tp when etp = 1, where
        the tp ranks route disjoint tokens), each storing its input e·h, the expert's inner
        activations (3 for swiglu, else 2)·e·f_e/etp and its output e·h (the combine's weight gradient):
        tokens x k x hidden twice, the "dispatch activations";
        the shared experts like a dense MLP of width moe_shared_experts·f_e (split over tp).
    all-to-all bytes per step (per rank, sent; ep > 1): per MoE layer and micro-batch, one pass sends
        (ep-1)/ep of the h·e bytes of each assignment the rank routes (T·k; / tp under sequence
        parallelism or etp = 1), plus, with etp = tp under sequence parallelism, tp-1 copies of what
        arrived over tp. Dispatch and combine in forward and their gradients in backward make 4 passes
        (6 with full recompute, which runs the forward twice), times the stage's MoE layers and the
        micro-batches of a step.

Extras: the first stage stores the embedding-dropout mask, the last stage the final-norm and output-layer
inputs and the fp32 logits (4·V/tp bytes per token, vocab-parallel cross entropy; soft-capped logits keep
their tanh's output too, e·V/tp); one micro-batch of
those is alive on the last stage. Not counted: temporary buffers, communication buffers, allocator
fragmentation, the CUDA context. The embedding, output layer and logits count the padded vocabulary
(``model.make_vocab_size_divisible_by`` x tp rows: what is allocated); the parameter count in the report
header is the model's real one.

The per-layer terms describe a Megatron-like implementation (fused SwiGLU that keeps gate and up only,
norms that keep their input). Unfused code stores more: against transformers' LLaMA (fp32, eager, 2 layers,
h=128, s=128) this predicts 22% less than the saved-tensor bytes measured with autograd hooks (its RMSNorm
keeps fp32 intermediates, its SwiGLU four f-wide tensors), and 15% less for GPT-2 with dropout.
"""

import math
from dataclasses import asdict, dataclass, field, fields, replace
from functools import lru_cache, wraps
from typing import Any, Mapping, Optional

from megand.core.optimizer.registry import optimizer_for, record
from megand.core.parallel_layout import LayoutError, ParallelLayout
from megand.core.pipeline_parallel.actions import peak_live_chunks
from megand.core.pipeline_parallel.layout import stage_layers as layers_of_stages
from megand.core.sharding import EMBEDDING, EXPERT_MATRIX, MATRIX
from megand.core.tensor_parallel.fp8_recipes import fp8_recipe
from megand.models.flops import (FrozenModel, Shape, layer_params, mtp_depth_extra, norm_params,
                                 per_layer_projection_params)

SHARDING_LEVELS = ("none", "optim", "optim_grads", "optim_grads_params")
PARALLEL_KEYS = tuple(f.name for f in fields(ParallelLayout))  # tp, pp, cp, dp, vpp, order, dp_shard, ep, etp, pp_schedule


@dataclass(frozen=True)
class Layout:
    """What the estimate depends on: the parallel layout (megand's one layout value, validated there) and
    the run's memory-relevant choices. :meth:`of` takes them as flat keys."""

    parallel: ParallelLayout = ParallelLayout()
    sequence_parallel: bool = False
    distributed_optimizer: bool = False  # the old flag: at least optim.sharding=optim
    sharding: str = "none"             # none | optim | optim_grads | optim_grads_params
    bucket_size: int = 40_000_000      # elements per bucket (ZeRO-3 gathers one bucket at a time)
    reshard_after_forward: bool = True  # ZeRO-3: free gathered buckets after forward
    precision: str = "bf16"            # fp32 | bf16 | fp16
    recompute: str = "none"            # none | selective | full
    recompute_layers: Optional[tuple] = None  # per virtual stage: how many of its first layers recompute; None: all
    micro_batch_size: int = 1
    num_microbatches: Optional[int] = None  # per dp rank and step; None: enough to fill the pipeline
    fused_attention: bool = False      # flash / memory-efficient kernel: no s×s probabilities stored
    pipeline_layout: Optional[tuple] = None  # layers per virtual stage (pp·vpp entries); None: even
    optimizer: str = "adamw"           # optim.name: a registered optimizer (its record: states per role, matrix work)
    fp8_gather: Optional[str] = None   # ZeRO-3 gathers the FP8 layers' weights in FP8 under this recipe (train.fp8, not compiled)
    fp8_bf16_layers: int = 1           # train.fp8_bf16_layers: first and last layers kept in bf16

    def __post_init__(self):
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"precision must be fp32|bf16|fp16, got {self.precision!r}")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"recompute must be none|selective|full, got {self.recompute!r}")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro batch size {self.micro_batch_size} must be >= 1")
        if self.sharding not in SHARDING_LEVELS:
            raise ValueError(f"sharding must be {'|'.join(SHARDING_LEVELS)}, got {self.sharding!r}")
        if self.recompute_layers is not None and len(self.recompute_layers) != self.pp * (self.vpp or 1):
            raise ValueError(f"recompute_layers={list(self.recompute_layers)} needs one entry per virtual stage "
                             f"(pp*vpp = {self.pp * (self.vpp or 1)})")

    @classmethod
    def of(cls, **keys) -> "Layout":
        """A layout from flat keys: the parallel ones (:data:`PARALLEL_KEYS`: a LayoutError, a ValueError,
        names values that break a rule) and this class's fields."""
        sizes = {k: keys.pop(k) for k in PARALLEL_KEYS if k in keys}
        return cls(parallel=parallel_layout(**sizes), **keys)

    @classmethod
    def from_config(cls, parallel: Mapping[str, Any], train: Mapping[str, Any], optim: Mapping[str, Any],
                    world_size: Optional[int] = None) -> "Layout":
        """From the ``parallel``, ``train`` and ``optim`` config groups (``dp: null`` needs world_size)."""
        layout = ParallelLayout.from_keys(parallel, world_size)
        micro = int(train.get("micro_batch_size") or 1)
        gbs = train.get("global_batch_size")
        return cls(parallel=layout, sequence_parallel=bool(parallel.get("sequence_parallel", False)),
                   sharding=optim.get("sharding") or "none",
                   bucket_size=int(optim.get("bucket_size") or 40_000_000),
                   reshard_after_forward=bool(optim.get("reshard_after_forward", True)),
                   precision=train.get("precision") or "bf16", recompute=train.get("recompute") or "none",
                   recompute_layers=(tuple(train.get("recompute_layers")) if train.get("recompute_layers") is not None
                                     else None),
                   micro_batch_size=micro,
                   num_microbatches=layout.microbatches(int(gbs), micro) if gbs else None,
                   pipeline_layout=(tuple(layers_of_stages(parallel.get("pipeline_layout")))
                                    if parallel.get("pipeline_layout") else None),
                   optimizer=optim.get("name") or "adamw",
                   fp8_gather=None if train.get("compile") else train.get("fp8"),
                   fp8_bf16_layers=int(train.get("fp8_bf16_layers", 1)))

    @property
    def heterogeneous(self) -> bool:
        """Pipeline stages of different tensor-parallel widths (or sequence parallelism)."""
        return self.parallel.heterogeneous

    def at_stage(self, stage: int) -> "Layout":
        """The one-width layout the ranks of pipeline rank ``stage`` see (its own tp and sequence
        parallelism; the pipeline, layers and batch unchanged): every term of that stage but the hand-off
        between widths is counted at it. ``self`` where the stages have one width."""
        return _at_stage(self, stage) if self.heterogeneous else self

    @property
    def level(self) -> str:
        """The sharding level in effect (the old ``distributed_optimizer`` flag means ``optim``)."""
        return "optim" if self.sharding == "none" and self.distributed_optimizer else self.sharding

    def as_dict(self) -> dict:
        """The flat keys (:meth:`of` takes them back)."""
        return {**{k: getattr(self.parallel, k) for k in PARALLEL_KEYS},
                **{f.name: getattr(self, f.name) for f in fields(self) if f.name != "parallel"}}

    # the parallel layout's sizes and options
    tp = property(lambda self: self.parallel.tp)
    pp = property(lambda self: self.parallel.pp)
    vpp = property(lambda self: self.parallel.vpp)
    cp = property(lambda self: self.parallel.cp)
    dp = property(lambda self: self.parallel.dp)
    dp_shard = property(lambda self: self.parallel.dp_shard)
    ep = property(lambda self: self.parallel.ep)
    etp = property(lambda self: self.parallel.etp)
    pp_schedule = property(lambda self: self.parallel.pp_schedule)

    @property
    def shards(self) -> int:
        """Ranks one state is sharded over (1: replicated)."""
        return 1 if self.level == "none" else self.parallel.shard_size

    @property
    def expert_tp(self) -> int:
        return self.parallel.expert_tp

    @property
    def edp(self) -> int:
        """Ranks holding the same expert shard (expert data parallelism): tp·dp·cp / (ep·etp)."""
        return self.parallel.edp

    @property
    def expert_shards(self) -> int:
        """Ranks one expert state is sharded over (1: replicated): the expert-data-parallel group."""
        return 1 if self.level == "none" else self.edp

    @property
    def interleaved(self) -> bool:
        return self.parallel.interleaved

    @property
    def sp(self) -> bool:
        """Sequence parallelism only changes anything with tensor parallelism."""
        return self.sequence_parallel and self.tp > 1


@lru_cache(maxsize=4096)
def _at_stage(layout: Layout, stage: int) -> Layout:
    """:meth:`Layout.at_stage`, once per layout and stage (the planner asks for every stage of many)."""
    return replace(layout, parallel=layout.parallel.for_stage(stage),
                   sequence_parallel=layout.parallel.stage_sp_of(stage))


@lru_cache(maxsize=4096)
def parallel_layout(**sizes) -> ParallelLayout:
    """The :class:`ParallelLayout` of ``sizes``, made (and checked) once per distinct layout: the estimator
    and the planner ask for the same few layouts many times."""
    return ParallelLayout(**sizes)


def state_bytes_per_param(layout: Layout, shards: Optional[int] = None, states: int = 2) -> dict:
    """Bytes per locally held parameter: params, grads, optimizer (main params + ``states`` fp32 states:
    Adam's m and v by default), each divided by the shard group size (``shards``, default the dense one)
    when the sharding level shards it."""
    d, level = layout.shards if shards is None else shards, layout.level
    params, optimizer = (4.0, 4.0 * states) if layout.precision == "fp32" else (2.0, 4.0 + 4.0 * states)
    return {"params": params / (d if level == "optim_grads_params" else 1),
            "grads": 4.0 / (d if level in ("optim_grads", "optim_grads_params") else 1),
            "optimizer": optimizer / d}


def gathered_bytes(params: float, layout: Layout, fp8_params: float = 0.0) -> float:
    """ZeRO-2/3 working set beyond the shards: gathered parameter buckets and gradient scratch buckets.

    ``fp8_params``: the stage's weights that ZeRO-3 gathers in FP8 for forward, and for backward under a
    one-scale recipe (its record's ``one_scale``, tensorwise): one byte per element; rowwise and MX gather the
    bf16 weight for backward, so their peak stays two. They fill buckets of their own; held buckets are
    counted as the other parameters' first (an upper bound)."""
    level = layout.level
    if level not in ("optim_grads", "optim_grads_params") or layout.shards == 1:
        return 0.0
    two_buckets = min(2 * layout.bucket_size, params)  # a stage of fewer parameters has fewer buckets
    scratch = two_buckets * 4  # fp32 gradient buckets being accumulated / reduce-scattered
    if level == "optim_grads":
        return scratch
    elem = 4 if layout.precision == "fp32" else 2
    held = params if not layout.reshard_after_forward else two_buckets
    if not layout.fp8_gather or not fp8_recipe(layout.fp8_gather).one_scale or elem != 2:
        return scratch + held * elem
    high = min(held, params - fp8_params)
    return scratch + high * elem + (held - high) * 1


def stage_fp8_gathered_params(model: Mapping[str, Any], layout: Layout, stage: int) -> float:
    """Weights of pipeline ``stage`` (one tensor-parallel rank's share) that ZeRO-3 gathers in FP8: the dense
    linear layers (attention's QKV and output projection, the MLP or shared experts' fc1 and fc2) of the
    transformer layers in FP8 (all but the first and last ``fp8_bf16_layers``); routed experts, norms,
    embedding and output layer are gathered in high precision."""
    if not layout.fp8_gather:
        return 0.0
    shape = Shape.from_config(model)
    total = 0.0
    for i in stage_layers(shape.layers, layout, stage):
        if layout.fp8_bf16_layers <= i < shape.layers - layout.fp8_bf16_layers:
            lp = layer_params(shape, moe=shape.is_moe(i), layer=i)
            total += (lp.qkv_weight + lp.proj_weight + lp.mlp_in_weight + lp.mlp_out_weight) / layout.tp
    return total


def stage_fp8_cache_bytes(model: Mapping[str, Any], layout: Layout, stage: int) -> float:
    """The step's FP8 weight cache on a rank of pipeline ``stage``: a recipe that keeps one (its record's
    ``weight_cache_bytes`` per element, tensorwise: one byte) quantises each FP8 layer's weights once per step
    and holds them through the last backward, a copy per view a product reads: every FP8 linear's weight once,
    the SwiGLU fc1's twice (its forward reads the gate and up rows apart, its input gradient the whole
    weight). None compiled (``fp8_gather`` unset) or under ZeRO-3 (each gathered weight is freed instead)."""
    if not layout.fp8_gather or layout.level == "optim_grads_params":
        return 0.0
    per_element = fp8_recipe(layout.fp8_gather).weight_cache_bytes
    if not per_element:
        return 0.0
    shape = Shape.from_config(model)
    total = 0.0
    for i in stage_layers(shape.layers, layout, stage):
        if layout.fp8_bf16_layers <= i < shape.layers - layout.fp8_bf16_layers:
            lp = layer_params(shape, moe=shape.is_moe(i))
            fc1_copies = 2 if shape.swiglu else 1
            total += (lp.qkv_weight + lp.proj_weight + fc1_copies * lp.mlp_in_weight + lp.mlp_out_weight) / layout.tp
    return per_element * total


def _activation_elem_bytes(layout: Layout) -> int:
    return 4 if layout.precision == "fp32" else 2


def _dropout(model: Mapping[str, Any], key: str) -> bool:
    return float(model.get(key, 0.0) or 0.0) > 0.0


def routed_assignments(model: Mapping[str, Any], layout: Layout) -> float:
    """Token-expert assignments one rank's experts process per MoE layer and micro-batch (balanced routing)."""
    shape = Shape.from_config(model)
    tokens = layout.micro_batch_size * shape.seq / layout.cp
    return tokens * shape.top_k / (layout.tp if layout.expert_tp == 1 else 1)


def moe_block_activation_bytes(model: Mapping[str, Any], layout: Layout) -> float:
    """What a MoE block stores beyond its input for one micro-batch on one rank: router scores, the
    dispatched tokens through the routed experts, the shared experts (see the module docstring)."""
    shape = Shape.from_config(model)
    e = _activation_elem_bytes(layout)
    tokens = layout.micro_batch_size * shape.seq / layout.cp
    seq_split = layout.tp if layout.sp else 1
    inner = 3 if shape.swiglu else 2
    capacity = max(1.0, float(model.get("moe_capacity_factor") or 1.0))
    routed = capacity * routed_assignments(model, layout) * (2 * e * shape.hidden
                                                             + inner * e * shape.moe_ffn / layout.expert_tp)
    shared = tokens * inner * e * shape.shared_experts * shape.moe_ffn / layout.tp
    return tokens * 8 * shape.experts / seq_split + routed + shared


def linear_attention_bytes(shape: Shape, e: int, recompute: str) -> float:
    """Per token, split over tp: what a Gated DeltaNet token mixer stores for backward (the C channels of its
    convolution: 2·Hk·dk + Hv·dv). Kept under any recomputation but full: its in-projections' outputs
    e·(2·Hk·dk + 2·Hv·dv + 2·Hv), the fp32 core input and gates 4·(C + 4·Hv), the gated norm's input and the
    output projection's input 2·e·Hv·dv and its fp32 products 12·Hv·dv. The core (dropped by selective
    recomputation) runs in fp32: the convolution's input, sum and activation 12·C, per value head five C×C
    chunk matrices (decays, masks, the triangular system, the intra-chunk scores), the normalised, decayed and
    solved queries, keys and values 4·(5·C + 8·dk + 5·dv), and the state at each chunk boundary 4·dk·dv/C (the
    recurrent state's memory)."""
    from megand.core.transformer.gated_deltanet import CHUNK

    Hk, Hv, dk, dv = shape.lin_k_heads, shape.lin_v_heads, shape.lin_dk, shape.lin_dv
    channels = 2 * Hk * dk + Hv * dv
    kept = e * (2 * Hk * dk + 2 * Hv * dv + 2 * Hv) + 4 * (channels + 4 * Hv) + 2 * e * Hv * dv + 12 * Hv * dv
    if recompute == "selective":
        return kept
    core = 12 * channels + 4 * Hv * (5 * CHUNK + 8 * dk + 5 * dv + dk * dv / CHUNK)
    return kept + core * shape.linear_padded_seq / shape.seq


def sparse_attention_bytes(shape: Shape, layout: Layout, e: int, recompute: str, dropout: bool) -> tuple:
    """DeepSeek Sparse Attention per token of one layer: (its attention core, split over tp; its other terms,
    not split). ``s`` keys, ``k`` = min(top-k, s) chosen, ``a`` heads at the kernels' padded width ``w``,
    ``hi`` x ``di`` indexer heads.

    The dense mask (short sequences): the core's a·s·e (a·s·(2e + 1) with dropout) as dense attention, and
    the chosen-key mask s bytes; with the indexer loss the indexer's score products and scores in fp32,
    4·s·(hi + 3) (products, scores, their log-softmax, the target).
    The top-k path: no core (its blocks keep only their inputs and recompute in backward), the chosen keys'
    indices and validity 9·k; with the indexer loss the target over them 4·k.
    Both, with the indexer loss (else no gradient reaches the indexer and it keeps nothing): its queries
    e·hi·di, its key and key-norm input 2·e·di, its head weights 4·hi. Under cp (cp > 1) the keys and values
    of the other ranks' tokens, gathered for every query's top-k: 2·a·w·e·(cp - 1), and their indexer keys
    e·di·(cp - 1). Not counted: one block's working set (``BLOCK_ELEMENTS`` elements, whatever s)."""
    s, k, a, hi, di = shape.seq, shape.index_keys, shape.heads, shape.index_heads, shape.index_dim
    w = max(shape.head_dim, shape.v_head)
    loss = shape.index_loss
    if shape.topk_path:
        core, kept = 0.0, 9 * k + (4 * k if loss else 0)
    else:
        core = a * s * ((2 * e + 1) if dropout else e)
        if layout.fused_attention:
            core = 4 * a
        core = 0.0 if recompute == "selective" else core
        kept = s + (4 * s * (hi + 3) if loss else 0)
    if loss:
        kept += e * hi * di + 2 * e * di + 4 * hi
    gathered = layout.cp - 1
    return core + 2 * a * w * e * gathered, kept + e * di * gathered


def layer_activation_bytes(model: Mapping[str, Any], layout: Layout, recompute: Optional[str] = None,
                           moe: bool = False, linear: bool = False, layer: Optional[int] = None) -> float:
    """Bytes one layer (``moe``: a MoE layer; ``linear``: a Gated DeltaNet layer; ``layer``: its id, where the
    layers' attention differs, else None) stores for backward for one micro-batch on one rank (see the module
    docstring)."""
    shape = Shape.from_config(model)
    recompute = layout.recompute if recompute is None else recompute
    e = _activation_elem_bytes(layout)
    own, rows = shape.at(layer), shape.kv_rows(layer)
    h, q, f, kv, a, s = shape.hidden, own.q_dim, shape.ffn_of(layer), own.kv_dim, shape.heads, shape.seq
    tokens = layout.micro_batch_size * s / layout.cp
    seq_split = layout.tp if layout.sp else 1
    if recompute == "full":  # a layer whose keys and values later layers read keeps them for those layers
        shared = layer is not None and layer in shape.kv_sources
        return tokens * (e * h / seq_split + (e * 2 * kv / layout.tp if shared else 0))
    masks = 2 * h if _dropout(model, "hidden_dropout") else 0
    replicated = (2 + shape.layer_norms) * e * h + masks  # sandwich: the two branch-output norms' inputs too
    replicated += (2 * e * h + 4 * e * shape.ple) if shape.ple else 0  # the per-layer input's gated branch
    beside = moe and shape.moe_beside  # Gemma 4: the dense MLP stays beside the experts
    replicated += 4 * e * h if beside else 0
    mlp = (3 if shape.swiglu else 2) * e * f if beside or not moe else 0
    values = (e * kv if shape.v_norm else 0) + (e * kv if rows == 2 else 0)  # the value norm's output, V's rows
    split = e * (q + (kv if rows else 0)) + (values if rows else 0) + e * q + mlp
    core = a * s * ((2 * e + 1) if _dropout(model, "attention_dropout") else e)
    if layout.fused_attention:
        core = 4 * a  # the kernel keeps one fp32 log-sum-exp per query and head
    if recompute == "selective":
        core = 0
    indexer = 0.0
    if shape.index_topk and not linear:
        core, indexer = sparse_attention_bytes(shape, layout, e, recompute, _dropout(model, "attention_dropout"))
    if linear:  # the token mixer is Gated DeltaNet's instead of attention's
        split = linear_attention_bytes(shape, e, recompute) + mlp
        core = 0
    block = moe_block_activation_bytes(model, layout) if moe else 0.0
    return tokens * (replicated / seq_split + (split + core) / layout.tp + indexer) + block


def stage_layer_count(num_layers: int, layout: Layout, stage: int) -> float:
    """Transformer layers held by pipeline ``stage`` (all its model chunks): from
    ``layout.pipeline_layout`` when set, else the even split."""
    if layout.pipeline_layout is not None:
        return float(sum(layout.pipeline_layout[s] for s in _virtual_stages(layout, stage)))
    return num_layers / layout.pp


def _virtual_stages(layout: Layout, stage: int) -> list:
    """The virtual stages pipeline rank ``stage`` holds under its schedule's placement."""
    return layout.parallel.placement.stages_of(stage)


def last_stage(layout: Layout) -> int:
    """The pipeline rank holding the output layer and the loss: the last, or rank 0 of a V schedule."""
    return layout.parallel.last_stage_rank


def layer_microbatches_in_flight(num_layers: int, layout: Layout, stage: int) -> float:
    """Layers × micro-batches whose activations are alive at once on pipeline ``stage`` (peak): the most
    chunk forwards the stage's action list holds before their backward (the schedule the executor runs),
    each chunk counted at the stage's mean chunk size."""
    if layout.pp == 1:
        return float(num_layers)  # one micro-batch at a time through every layer
    v = layout.vpp if layout.interleaved else 1
    return chunks_in_flight(layout, stage) * stage_layer_count(num_layers, layout, stage) / v


def chunks_in_flight(layout: Layout, stage: int) -> int:
    """Chunk forwards (a micro-batch through one of the stage's model chunks) alive at once on pipeline
    ``stage`` at its peak (pp > 1), on the schedule's action list."""
    pp, m = layout.pp, layout.num_microbatches
    v = layout.vpp if layout.interleaved else 1
    if m is None:  # enough micro-batches to reach the steady state (m == pp would run interleaving all warm-up)
        m = 2 * pp if v > 1 else pp
    # a count the schedule's rule refuses (the executor would): the next it runs
    rule = layout.parallel.schedule.microbatch_rule(pp, v if v > 1 else None)
    m = rule.smallest_at_least(m)
    # past the warm-up every schedule holds a steady number of chunks: its peak at 2·pp·v micro-batches is
    # its peak at any more (tests/unit/test_estimate_saturation.py), and replaying thousands is what the
    # planner cannot afford on every layout
    m = min(m, rule.smallest_at_least(2 * pp * v))
    return _live_chunks(pp, v, m, stage, layout.pp_schedule)


# the planner asks for every rank of hundreds of pipelines: more distinct answers than core's own cache
# holds (each a replay of the action list), and each only an int
_live_chunks = lru_cache(maxsize=None)(peak_live_chunks)


def microbatches_in_flight(layout: Layout, stage: int) -> int:
    """Whole micro-batches started but not finished on ``stage`` (for per-micro-batch extras)."""
    if layout.pp == 1:
        return 1
    inflight = layout.pp - stage
    return inflight if layout.num_microbatches is None else min(inflight, layout.num_microbatches)


def stage_layers(num_layers: int, layout: Layout, stage: int) -> list:
    """The layer ids of pipeline ``stage``: virtual stages ``stage, stage + pp, ...`` of
    ``layout.pipeline_layout`` when set; else the even split (contiguous runs, or interleaved chunks with vpp)."""
    if layout.pipeline_layout is not None:
        bounds = [0]
        for n in layout.pipeline_layout:
            bounds.append(bounds[-1] + n)
        return [i for j in _virtual_stages(layout, stage) for i in range(bounds[j], bounds[j + 1])]
    if layout.interleaved:
        chunk = math.ceil(num_layers / (layout.pp * layout.vpp))
        starts = [s * chunk for s in _virtual_stages(layout, stage)]
        return [i for start in starts for i in range(start, min(start + chunk, num_layers))]
    per_stage = math.ceil(num_layers / layout.pp)
    ids = list(range(stage * per_stage, min((stage + 1) * per_stage, num_layers)))
    return ids or list(range(per_stage))  # more stages than layers: count one stage's worth


def virtual_stage_sizes(num_layers: int, layout: Layout) -> list:
    """Layers of each virtual stage (pp·vpp entries): ``layout.pipeline_layout``, else the even split
    (rounded up as :func:`stage_layers` counts it)."""
    if layout.pipeline_layout is not None:
        return list(layout.pipeline_layout)
    stages = layout.pp * (layout.vpp if layout.interleaved else 1)
    chunk = math.ceil(num_layers / stages)
    return [max(0, min((j + 1) * chunk, num_layers) - j * chunk) for j in range(stages)]


def layer_recompute(num_layers: int, layout: Layout):
    """``layer id -> recompute mode``: ``layout.recompute`` for the first ``recompute_layers[j]`` layers of
    each virtual stage j (every layer when ``recompute_layers`` is None), ``none`` for the others."""
    if layout.recompute_layers is None or layout.recompute == "none":
        return lambda i: layout.recompute
    from megand.core.pipeline_parallel.layout import recomputed_layer_ids

    sizes = virtual_stage_sizes(num_layers, layout)
    ids = recomputed_layer_ids(sizes, [min(int(n), have) for n, have in zip(layout.recompute_layers, sizes)])
    return lambda i: layout.recompute if i in ids else "none"


def stage_moe_layers(model: Mapping[str, Any], layout: Layout, stage: int) -> int:
    shape = Shape.from_config(model)
    if not shape.experts:  # dense: no layer to look at (the planner asks this for every layout)
        return 0
    return sum(shape.is_moe(i) for i in stage_layers(shape.layers, layout, stage))


def stage_expert_params(model: Mapping[str, Any], layout: Layout, stage: int) -> float:
    """Routed-expert parameters held by one rank of pipeline ``stage`` (its share over ep and etp)."""
    shape = Shape.from_config(model)
    if not shape.experts:
        return 0.0
    moe = layer_params(shape, moe=True)
    layers = stage_moe_layers(model, layout, stage)
    if stage == layout.pp - 1:  # the multi-token prediction layers that are MoE
        layers += sum(shape.is_moe(i) for i in shape.mtp_layer_ids)
    return layers * (moe.experts_split / (layout.ep * layout.expert_tp) + moe.experts_replicated / layout.ep)


def per_frozen_model(fn):
    """Memoise ``fn(model, layout, stage)`` when ``model`` is a :class:`FrozenModel` (the planner's: one
    estimate asks about the same stage's parameters several times, the search about thousands of
    layouts); any other mapping is computed every time, as it may change between calls."""
    cached = lru_cache(maxsize=1 << 18)(fn)

    @wraps(fn)
    def wrapper(model, layout, stage):
        return cached(model, layout, stage) if isinstance(model, FrozenModel) else fn(model, layout, stage)

    return wrapper


@per_frozen_model
def stage_layer_params(model: Mapping[str, Any], layout: Layout, stage: int) -> float:
    """Parameters of the transformer layers held by one tensor-parallel rank of pipeline ``stage``
    (``pipeline_layout``'s layers, or the even split rounded up), routed experts included."""
    shape = Shape.from_config(model)
    n_moe = stage_moe_layers(model, layout, stage)
    layers = (stage_layer_count(shape.layers, layout, stage) if layout.pipeline_layout is not None
              else math.ceil(shape.layers / layout.pp))
    if shape.linear or shape.varied:  # the token mixers (or attention shapes) differ per layer: the stage's own
        return sum(layer_params(shape, moe=shape.is_moe(i), layer=i).per_tp_rank(layout.tp, layout.ep, layout.expert_tp)
                   for i in stage_layers(shape.layers, layout, stage))
    return ((layers - n_moe) * layer_params(shape).per_tp_rank(layout.tp)
            + n_moe * layer_params(shape, moe=True).per_tp_rank(layout.tp, layout.ep, layout.expert_tp))


@per_frozen_model
def stage_params(model: Mapping[str, Any], layout: Layout, stage: int) -> float:
    """Parameters held by one tensor-parallel rank of pipeline ``stage`` (``pipeline_layout``'s layers, or
    the even split rounded up), routed experts included (their share over ep and etp)."""
    shape = Shape.from_config(model)
    params = stage_layer_params(model, layout, stage)
    # vocab-parallel embedding / output layer, padding rows included (they are allocated)
    word = shape.padded_vocab(layout.tp) * shape.hidden / layout.tp
    if stage == 0:
        params += word + (shape.seq * shape.hidden if shape.learned_positions else 0)
        params += per_layer_projection_params(shape)
    if stage == last_stage(layout):
        params += norm_params(shape)
        # untied: the output layer; tied with pp>1: the last stage holds a copy of the embedding
        if not shape.tied or layout.pp > 1:
            params += word
        params += mtp_stage_params(shape, layout)
    return params


def mtp_stage_params(shape: Shape, layout: Layout) -> float:
    """The multi-token prediction depths' parameters on one tensor-parallel rank of the last stage: their
    layers, projections (split over tp) and norms, and (untied, pp > 1) the word embedding's copy they read."""
    if not shape.mtp_layers:
        return 0.0
    layers = sum(layer_params(shape, moe=shape.is_moe(i)).per_tp_rank(layout.tp, layout.ep, layout.expert_tp)
                 for i in shape.mtp_layer_ids)
    proj = 2 * shape.hidden * shape.hidden
    copy = shape.padded_vocab(layout.tp) * shape.hidden / layout.tp if not shape.tied and layout.pp > 1 else 0
    return layers + shape.mtp_layers * (mtp_depth_extra(shape) - proj + proj / layout.tp) + copy


@dataclass
class StageMemory:
    stage: int
    params: float                          # every parameter this rank holds, its routed-expert share included
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes_per_layer: float      # one layer, one micro-batch
    layer_microbatches_in_flight: float
    layer_activation_bytes: float          # the two above multiplied
    extra_activation_bytes: float          # embedding / final norm / logits
    gathered_bytes: float                  # ZeRO-2/3: gathered parameter and gradient buckets
    recompute_working_bytes: float         # full recompute: one layer's activations during backward
    expert_params: float = 0.0             # of ``params``: routed experts (split over ep, etp; sharded over edp)
    moe_layers: int = 0                    # MoE layers on this stage
    all_to_all_bytes_per_step: float = 0.0  # expert-parallel dispatch + combine, sent by this rank per step
    fp8_cache_bytes: float = 0.0           # the FP8 layers' weights quantised once for the step (train.fp8)
    tp: int = 1                            # the stage's tensor-parallel width (its own, with stages of different widths)
    sequence_parallel: bool = False        # the stage's sequence parallelism (over tp > 1)
    hand_off_bytes: float = 0.0            # stages of different widths: what the hand-off holds (:func:`hand_off_bytes`)
    total_bytes: float = field(init=False)

    def __post_init__(self):
        self.total_bytes = (self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.gathered_bytes
                            + self.fp8_cache_bytes + self.hand_off_bytes
                            + self.layer_activation_bytes
                            + self.extra_activation_bytes + self.recompute_working_bytes)


@dataclass
class MemoryEstimate:
    stages: list  # of StageMemory: the first and (when pp > 1) the last pipeline stage

    @property
    def peak(self) -> StageMemory:
        return max(self.stages, key=lambda st: st.total_bytes)

    def as_dict(self) -> dict:
        return {"stages": [asdict(st) for st in self.stages], "peak_stage": self.peak.stage,
                "peak_total_bytes": self.peak.total_bytes}


def _extra_activation_bytes(model: Mapping[str, Any], layout: Layout, stage: int) -> float:
    shape = Shape.from_config(model)
    e = _activation_elem_bytes(layout)
    tokens = layout.micro_batch_size * shape.seq / layout.cp
    seq_split = layout.tp if layout.sp else 1
    extra = 0.0
    if stage == 0 and _dropout(model, "hidden_dropout"):
        extra += microbatches_in_flight(layout, stage) * tokens * shape.hidden / seq_split
    if shape.ple:  # every layer's projected word embedding, until the micro-batch's backward (+ its norm's input)
        extra += (microbatches_in_flight(layout, stage) * tokens * e * shape.layers * shape.ple
                  * (2 if stage == 0 else 1) / seq_split)
    if stage == last_stage(layout):
        # the final norm and output-layer inputs, and at the loss the logits next to the one fp32 copy the
        # vocab-parallel cross entropy turns into its softmax; with multi-token prediction each depth's too
        # (one product with the main model's), its layer (one micro-batch: the last stage's only one in
        # flight) and its norms' and projection's inputs
        depths = shape.mtp_layers
        logits = (4 + e * (2 if shape.softcap else 1)) * shape.padded_vocab(layout.tp) / layout.tp
        extra += (1 + depths) * tokens * (2 * e * shape.hidden / seq_split + logits)
        extra += sum(layer_activation_bytes(model, layout, moe=shape.is_moe(i)) for i in shape.mtp_layer_ids)
        extra += depths * tokens * 4 * e * shape.hidden / seq_split
    return extra


def all_to_all_bytes_per_step(model: Mapping[str, Any], layout: Layout, stage: int) -> float:
    """Bytes one rank of ``stage`` sends in expert-parallel all-to-alls per step (see the module docstring)."""
    if layout.ep == 1:
        return 0.0
    shape = Shape.from_config(model)
    tokens = layout.micro_batch_size * shape.seq / layout.cp
    # the tokens this rank routes: its sequence shard under sp or etp = 1
    routed = tokens * shape.top_k / (layout.tp if layout.sp or layout.expert_tp == 1 else 1)
    # experts split over tp with sp: the tokens that arrived are exchanged over tp too (every tp rank
    # holds a slice of each local expert), and the partial outputs back
    over_tp = layout.tp - 1 if layout.sp and layout.expert_tp > 1 else 0
    per_pass = routed * shape.hidden * _activation_elem_bytes(layout) * ((layout.ep - 1) / layout.ep + over_tp)
    mode = layer_recompute(shape.layers, layout)
    # dispatch + combine in forward, their gradients in backward; a fully recomputing layer's forward twice
    passes = sum(6 if mode(i) == "full" else 4 for i in stage_layers(shape.layers, layout, stage) if shape.is_moe(i))
    micro = layout.num_microbatches or layout.pp  # None: enough to fill the pipeline
    return micro * passes * per_pass


def matrix_step_cost(model: Mapping[str, Any], layout: Layout, stage: int) -> dict:
    """The whole-matrix work of the optimizer's step (its record's ``matrix_flops``, Muon's Newton-Schulz) on
    a rank of ``stage``: FLOPs and bytes sent; zeros for an elementwise optimizer.

    Each logical matrix m x n it takes (q, k, v and gate, up apart; each expert) costs ``matrix_flops(m, n)``
    (Muon: 5 iterations of ``X X^T`` (2 m^2 n), ``A A`` (2 m^3) and ``B X`` (2 m^2 n), m <= n), once per shard
    group, the matrices dealt round-robin over its tp x shard ranks (without sharding tp x dp x cp; HSDP
    replicas each repeat it; routed experts over their etp x expert-dp ranks). Moving the pieces: the owner
    receives and sends back the whole matrix (reduce + broadcast over the shard group, gather + scatter over
    tp): about two fp32 copies of the rank's share of the layers' matrices per step.
    """
    rec = record(layout.optimizer)
    if rec.matrix_flops is None:
        return {"flops": 0.0, "bytes": 0.0}
    shape = Shape.from_config(model)
    h, q, kv = shape.hidden, shape.q_dim, shape.kv_dim
    ns = rec.matrix_flops

    def mlp(f):
        return (3 if shape.swiglu else 2) * ns(f, h) if f else 0

    attention = ns(q, h) + 2 * ns(kv, h) + ns(h, q)
    n_moe = stage_moe_layers(model, layout, stage)
    layers = (stage_layer_count(shape.layers, layout, stage) if layout.pipeline_layout is not None
              else math.ceil(shape.layers / layout.pp))
    dense = (layers - n_moe) * mlp(shape.ffn) + layers * attention + n_moe * mlp(shape.shared_experts * shape.moe_ffn)
    experts = n_moe * shape.experts / layout.ep * mlp(shape.moe_ffn)
    # dealt over the shard group (without sharding: over dp x cp, every rank holding the whole local shard)
    group = layout.shards if layout.level != "none" else layout.dp * layout.cp
    flops = (dense / (layout.tp * group) if MATRIX in rec.roles else 0.0) + \
        (experts / (layout.expert_tp * layout.edp) if EXPERT_MATRIX in rec.roles else 0.0)
    return {"flops": flops, "bytes": 2 * 4.0 * stage_layer_params(model, layout, stage)}


def stage_params_by_role(model: Mapping[str, Any], layout: Layout, stage: int) -> dict[str, float]:
    """The parameters of one tensor-parallel rank of ``stage`` by the role they count under for the
    optimizer: the layers' as matrices (their norms, biases and router: a rounding error), the routed
    experts as expert matrices, the rest (embeddings, output layer, final norm) as embeddings."""
    params, layer = stage_params(model, layout, stage), stage_layer_params(model, layout, stage)
    experts = stage_expert_params(model, layout, stage)
    shape = Shape.from_config(model)  # per-layer input tables: embeddings held with their layers
    tables = len(stage_layers(shape.layers, layout, stage)) * shape.ple_vocab * shape.ple / layout.tp
    return {EMBEDDING: params - layer + tables, MATRIX: layer - experts - tables, EXPERT_MATRIX: experts}



@per_frozen_model
def stage_optimizer_bytes(model: Mapping[str, Any], layout: Layout, stage: int) -> float:
    """The fp32 main params (non-fp32 runs) and optimizer states one rank of ``stage`` holds: each role's
    parameters keep the state of the optimizer that takes them (``optim.name`` or its fallback: AdamW's two
    moments, Muon's and Lion's one), over their shard group."""
    shards = {EMBEDDING: None, MATRIX: None, EXPERT_MATRIX: layout.expert_shards}
    return sum(n * state_bytes_per_param(layout, shards[role], len(optimizer_for(layout.optimizer, role).state))
               ["optimizer"] for role, n in stage_params_by_role(model, layout, stage).items())


def estimate_memory(model: Mapping[str, Any], layout: Layout, stages=None) -> MemoryEstimate:
    """Per-rank memory of ``stages`` (default: the first and the last pipeline stage, and the most loaded
    one when it is another: with dense first layers (DeepSeek-V3) or an uneven layout a middle stage peaks).

    Stages of different widths: each stage is counted at its own width (:meth:`Layout.at_stage`: its
    parameters, gradients and optimizer shard, its activations with its micro-batches in flight under the
    schedule), plus the hand-off between widths (:func:`hand_off_bytes`)."""
    if stages is None:
        every = estimate_memory(model, layout, range(layout.pp)).stages
        peak = max(every, key=lambda st: st.total_bytes).stage
        return MemoryEstimate(stages=[st for st in every if st.stage in {0, layout.pp - 1, peak}])
    wanted = sorted(set(stages))
    if layout.heterogeneous:
        return MemoryEstimate(stages=[replace(_stage_at_width(model, layout.at_stage(s), s),
                                              hand_off_bytes=hand_off_bytes(model, layout, s)) for s in wanted])
    shape = Shape.from_config(model)
    dense_bytes, expert_bytes = state_bytes_per_param(layout), state_bytes_per_param(layout, layout.expert_shards)
    mode = layer_recompute(shape.layers, layout)
    stages = []
    for stage in wanted:
        params = stage_params(model, layout, stage)
        experts = stage_expert_params(model, layout, stage)
        held = {k: (params - experts) * dense_bytes[k] + experts * expert_bytes[k] for k in ("params", "grads")}
        held["optimizer"] = stage_optimizer_bytes(model, layout, stage)
        ids = stage_layers(shape.layers, layout, stage)
        n_moe = sum(shape.is_moe(i) for i in ids)
        # the stage's layers in proportion: every layer of a stage has the same micro-batches in flight
        kinds = [(mode(i), shape.is_moe(i), i in shape.linear, i if shape.varied else None) for i in ids]
        stored = {k: layer_activation_bytes(model, layout, recompute=k[0], moe=k[1], linear=k[2], layer=k[3])
                  for k in set(kinds)}
        per_layer = sum(stored[k] for k in kinds) / len(ids)
        inflight = layer_microbatches_in_flight(shape.layers, layout, stage)
        working = 0.0
        if any(k[0] == "full" for k in kinds):  # one recomputed layer's activations, during its backward
            working = max(layer_activation_bytes(model, layout, recompute="none", moe=n_moe > 0, layer=k[3])
                          for k in set(kinds) if k[0] == "full")  # the widest recomputed layer's
        stages.append(StageMemory(
            stage=stage, params=params,
            param_bytes=held["params"], grad_bytes=held["grads"], optimizer_bytes=held["optimizer"],
            activation_bytes_per_layer=per_layer, layer_microbatches_in_flight=inflight,
            layer_activation_bytes=per_layer * inflight,
            extra_activation_bytes=_extra_activation_bytes(model, layout, stage),
            gathered_bytes=gathered_bytes(params, layout, stage_fp8_gathered_params(model, layout, stage)),
            recompute_working_bytes=working, expert_params=experts, moe_layers=n_moe,
            all_to_all_bytes_per_step=all_to_all_bytes_per_step(model, layout, stage),
            fp8_cache_bytes=stage_fp8_cache_bytes(model, layout, stage), tp=layout.tp, sequence_parallel=layout.sp))
    return MemoryEstimate(stages=stages)


@per_frozen_model
def _stage_at_width(model: Mapping[str, Any], layout: Layout, stage: int) -> StageMemory:
    """``stage`` of the one-width ``layout`` (memoised for the planner, whose pipelines of different widths
    share their stages' one-width layouts; callers copy it, never change it)."""
    return estimate_memory(model, layout, [stage]).stages[0]


@per_frozen_model
def hand_off_bytes(model: Mapping[str, Any], layout: Layout, stage: int) -> float:
    """What the hand-off between stages of different widths (megand/core/pipeline_parallel/hand_off.py) holds
    on a rank of pipeline ``stage`` beyond a one-width pipeline (0 where every stage has one width):

    - each output a chunk sent to a virtual stage of another width (or sequence parallelism) stays alive
      until its backward: a one-width pipeline releases an activation's storage once it is sent (its
      backward needs only the shape), the hand-off's messages do not (a message may be the activation
      itself, sent to several receivers). Counted for the chunks in flight (:func:`chunks_in_flight`), in
      proportion of the rank's chunks that send to another width: e·h per token (/tp under sequence
      parallelism);
    - a sequence-parallel rank sending to another width gathers the whole activation (or, backward, the
      gradient) over its tp group first: one such message, e·h per token, while it is sent.
    """
    if not layout.heterogeneous:
        return 0.0
    par, own = layout.parallel, layout.at_stage(stage)
    placement = par.placement

    def width(virtual: int):
        rank = placement.location(virtual)[0]
        return par.stage_tp_of(rank), par.stage_sp_of(rank)

    mine, last = placement.stages_of(stage), placement.num_stages - 1
    to_other = sum(j < last and width(j + 1) != width(j) for j in mine)
    from_other = sum(j > 0 and width(j - 1) != width(j) for j in mine)
    shape = Shape.from_config(model)
    whole = own.micro_batch_size * shape.seq / own.cp * _activation_elem_bytes(own) * shape.hidden
    kept = chunks_in_flight(own, stage) * to_other / len(mine) * whole / (own.tp if own.sp else 1)
    gathered = whole if own.sp and (to_other or from_other) else 0.0
    return kept + gathered


# --- human-readable report -------------------------------------------------------------------------

def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def _count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:,.2f}{unit}"
    return f"{n:,.0f}"


def format_report(model: Mapping[str, Any], layout: Layout, estimate: MemoryEstimate) -> str:
    """A table of the estimate, one column per reported pipeline stage."""
    from megand.models.flops import model_flops_per_token, param_counts

    shape = Shape.from_config(model)
    counts = param_counts(model)
    moe = shape.moe_layers > 0
    head = [
        f"model   {shape.arch}: {shape.layers} layers, hidden {shape.hidden}, ffn {shape.ffn} "
        f"({'swiglu' if shape.swiglu else 'gelu'}), heads {shape.heads}/{shape.groups} kv, seq {shape.seq}, "
        f"vocab {shape.vocab} (padded {shape.padded_vocab(layout.tp)}), {'tied' if shape.tied else 'untied'}",
    ]
    if shape.mtp_layers:
        head.append(f"        multi-token prediction: {shape.mtp_layers} depths on the last stage, "
                    f"{_count(counts.mtp)} parameters")
    if moe:
        head.append(f"        MoE: {shape.moe_layers} of {shape.layers} layers, {shape.experts} experts of ffn "
                    f"{shape.moe_ffn}, top-{shape.top_k}, {shape.shared_experts} shared")
        head.append(f"        {_count(counts.total)} parameters, {_count(counts.active)} active per token "
                    f"({_count(counts.non_embedding)} / {_count(counts.active_non_embedding)} non-embedding), "
                    f"{model_flops_per_token(model, layout.tp) / 1e9:,.2f} GFLOP/token (fwd+bwd, active parameters)")
    else:
        head.append(f"        {_count(counts.total)} parameters ({_count(counts.non_embedding)} non-embedding), "
                    f"{model_flops_per_token(model, layout.tp) / 1e9:,.2f} GFLOP/token (fwd+bwd)")
    widths = (f"tp={list(layout.parallel.stage_tp)} (per stage) " if layout.heterogeneous else f"tp={layout.tp} ")
    sp = (f"sp={['on' if x else 'off' for x in layout.parallel.stage_sp]}" if layout.heterogeneous
          else f"sp={'on' if layout.sp else 'off'}")
    head += [
        f"layout  {widths}pp={layout.pp} vpp={layout.vpp} cp={layout.cp} dp={layout.dp} "
        + (f"ep={layout.ep} etp={layout.expert_tp} expert-dp={layout.edp} " if moe else "")
        + f"{sp} sharding={layout.level} over {layout.shards} "
        f"{layout.precision} recompute={layout.recompute}"
        + (f" recompute_layers={list(layout.recompute_layers)}" if layout.recompute_layers is not None else "")
        + f" micro_batch={layout.micro_batch_size} "
        f"micro_batches={layout.num_microbatches if layout.num_microbatches is not None else 'auto'}"
        f"{' fused_attention' if layout.fused_attention else ''}",
        "",
    ]
    names = {0: "first", layout.pp - 1: "last"}
    cols = [f"stage {st.stage} ({'only' if layout.pp == 1 else names.get(st.stage, 'most loaded')})" for st in estimate.stages]
    rows = [
        ("tensor-parallel width", lambda st: f"tp {st.tp}{' + sp' if st.sequence_parallel else ''}"),
        ("parameters per rank", lambda st: _count(st.params)),
        *([("  of which routed experts", lambda st: _count(st.expert_params))] if moe else []),
        ("  params", lambda st: _gib(st.param_bytes)),
        ("  grads", lambda st: _gib(st.grad_bytes)),
        ("  optimizer (main params + states)", lambda st: _gib(st.optimizer_bytes)),
        ("  gathered buckets (ZeRO-2/3)", lambda st: _gib(st.gathered_bytes)),
        *([("  FP8 weights for the step", lambda st: _gib(st.fp8_cache_bytes))]
          if any(st.fp8_cache_bytes for st in estimate.stages) else []),
        ("activations per layer, micro-batch", lambda st: _gib(st.activation_bytes_per_layer)),
        ("layer x micro-batches in flight", lambda st: f"{st.layer_microbatches_in_flight:g}"),
        ("  activations of the layers", lambda st: _gib(st.layer_activation_bytes)),
        ("  embedding / logits activations", lambda st: _gib(st.extra_activation_bytes)),
        ("  full-recompute working set", lambda st: _gib(st.recompute_working_bytes)),
        *([("  hand-off between widths", lambda st: _gib(st.hand_off_bytes))] if layout.heterogeneous else []),
        ("total", lambda st: _gib(st.total_bytes)),
        *([("all-to-all sent per step (ep)", lambda st: _gib(st.all_to_all_bytes_per_step))] if moe else []),
        *([(f"{record(layout.optimizer).matrix_step} GFLOP per step",
            lambda st: f"{matrix_step_cost(model, layout.at_stage(st.stage), st.stage)['flops'] / 1e9:,.1f}"),
           (f"{layout.optimizer.capitalize()} pieces moved per step",
            lambda st: _gib(matrix_step_cost(model, layout.at_stage(st.stage), st.stage)["bytes"]))]
          if record(layout.optimizer).matrix_flops is not None else []),
    ]
    width = max(len(r[0]) for r in rows) + 2
    colw = max(20, *(len(c) + 2 for c in cols))
    lines = head + ["".ljust(width) + "".join(c.rjust(colw) for c in cols)]
    for label, fmt in rows:
        lines.append(label.ljust(width) + "".join(fmt(st).rjust(colw) for st in estimate.stages))
    lines.append("")
    lines.append(f"peak: stage {estimate.peak.stage}, {_gib(estimate.peak.total_bytes)} per rank "
                 "(excludes temporary/communication buffers, fragmentation and the CUDA context; to size a device, "
                 "plan on tools/rehearse.py's measured peak, which includes them (not the CUDA context))")
    return "\n".join(lines)
