"""The Mixture-of-Experts block: router, token dispatch, routed experts as a grouped GEMM, shared experts.

Every layout routes identically: the router works in fp32 and ties go to the lower expert index. The
block runs on the layer's activation layout ``[s, b, h]`` and returns the same layout:

- experts split over tp (``expert_tensor_parallel``, etp = tp): each expert's fc1 is column-split and
  fc2 row-split like the dense MLP; every tp rank processes every token of the tp group (gathered from
  the sequence shards under sequence parallelism) and the partial outputs are summed over tp
  (all-reduce, or reduce-scatter back to the sequence shards under sp);
- whole experts on every tp rank (etp = 1): each tp rank routes and processes its own share of the
  tokens (its sequence shard under sp; otherwise a split of the sequence, gathered again at the end).

The tokens a rank routes are "its" tokens; the balancing statistics (per-expert counts, score sums,
z-loss sums) are summed over every rank holding tokens of the micro-batch (dp x cp, and tp when the
tokens are split over tp) with an all-reduce whose backward is the identity: each rank's scores receive
the gradient of their own share of the global loss, and the gradient reduction sums the shares.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F

from megand.core.expert_parallel import AllToAllDispatcher
from megand.core.expert_parallel.combine import weighted_sum
from megand.core.metrics import MAX, MEAN, SUM, Metric
from megand.core.sharding import BIAS, EXPERT_MATRIX, NORM, ROUTER, ParamMeta, retag, split_by_tokens, tag
from megand.core.host_reads import even_offsets, host_list
from megand.core.tensor_parallel.gemm import use_policy, weight_grad_target
from megand.core.tensor_parallel.wgrad import AccumulatingGemm, add_product, hand_over
from megand.core.tensor_parallel.gemm import DEFAULT, GemmPolicy
from megand.core.tensor_parallel.mappings import (
    copy_to_tp,
    gather_from_sp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_sp,
)
from megand.core.transformer.mlp import MLP, SwiGLU, clamped_swiglu
from megand.core.transformer.norms import Norm


def _param(shape, meta, dtype, device):
    return tag(torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device)), meta)


# ----------------------------------------------------------------------------------------------- routing
def count_per_expert(flat_experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert ``[num_experts]`` (int64), without reading the ids on the host (bincount
    would, on CUDA, to size its output)."""
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat_experts.device)
    return counts.scatter_add_(0, flat_experts, torch.ones_like(flat_experts))


def top_k_stable(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of each row; among equal values the lower index first."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def capacity_of(capacity_factor: float, tokens: int, top_k: int, num_experts: int) -> int:
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def capacity_keep(experts: torch.Tensor, scores: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """``[T, k]`` bool: the assignments each expert keeps, at most ``capacity`` per expert; over capacity
    the lowest scores are dropped first, and among equal scores the later token."""
    flat_e, flat_s = experts.reshape(-1), scores.reshape(-1)  # assignment t*k + j: token order
    order = torch.sort(flat_s, descending=True, stable=True).indices  # ties keep token order
    order = order[torch.sort(flat_e[order], stable=True).indices]  # grouped by expert, best first
    counts = count_per_expert(flat_e, num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(flat_e.numel(), device=flat_e.device) - starts[flat_e[order]]
    keep = torch.empty_like(flat_e, dtype=torch.bool)
    keep[order] = rank_in_expert < capacity
    return keep.view_as(experts)


class Router(torch.nn.Module):
    """``logits = x @ weight.T`` in fp32; softmax or sigmoid scores; top-k with deterministic ties.

    ``weight`` ``[E, h]`` is replicated over tp; ``sharded_tokens``: each tp rank routes other tokens
    (sequence parallelism or etp = 1), so its gradient is summed over tp. The sigmoid router chooses by
    ``scores + expert_bias`` (the auxiliary-loss-free balancing bias, a persistent fp32 buffer) and
    weights by the scores alone.

    Gemma 4's router (``model.moe_beside_mlp``) reads ``rmsnorm(x) * scale / sqrt(h)`` (``norm``, whose weight
    is the per-channel scale) and multiplies each chosen expert's weight by a learned ``expert_scale[e]``."""

    def __init__(self, cfg, topo, sharded_tokens: bool, device):
        super().__init__()
        self.num_experts, self.top_k, self.kind = cfg.num_experts, cfg.moe_top_k, cfg.moe_router
        self.norm_topk, self.scaling = cfg.moe_norm_topk_prob, cfg.moe_routed_scaling_factor
        self.groups, self.topk_groups = cfg.moe_n_group, cfg.moe_topk_group
        shape = (cfg.num_experts, cfg.hidden_size)
        self.weight = _param(shape, ParamMeta(shape, None, topo.tp_rank, topo.tp_size, init_std=cfg.init_std,
                                              input_split=split_by_tokens(sharded_tokens), role=ROUTER),
                             cfg.params_dtype, device)
        self.bias = None
        if cfg.moe_bias:  # on the logits (GPT-OSS): replicated over tp like the weight
            self.bias = _param((cfg.num_experts,), ParamMeta((cfg.num_experts,), None, topo.tp_rank, topo.tp_size,
                                                             init_std=cfg.init_std, role=BIAS,
                                                             input_split=split_by_tokens(sharded_tokens)),
                               cfg.params_dtype, device)
        self.norm = self.expert_scale = None
        if cfg.moe_beside_mlp:
            split = split_by_tokens(sharded_tokens)
            self.norm = Norm("rmsnorm", cfg.hidden_size, eps=cfg.norm_eps, input_split=split, tp_rank=topo.tp_rank,
                             tp_size=topo.tp_size, dtype=cfg.params_dtype, device=device)
            self.input_factor = cfg.hidden_size ** -0.5
            # a gain per expert, undecayed like a norm's weight
            self.expert_scale = _param((cfg.num_experts,), ParamMeta((cfg.num_experts,), None, topo.tp_rank, topo.tp_size,
                                                                     init="ones", input_split=split, role=NORM),
                                       cfg.params_dtype, device)
        if self.kind == "sigmoid":
            # state, not a parameter; tiny: created on the run's device even when the model is built on meta
            self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32, device=topo.device))
        else:
            self.expert_bias = None

    def forward(self, x):
        """``x [T, h]`` -> ``(logits [T, E], scores [T, E], experts [T, k], weights [T, k])``, fp32."""
        if self.norm is not None:
            x = self.norm(x) * self.input_factor
        logits = x.float() @ self.weight.float().t()
        if self.bias is not None:
            logits = logits + self.bias.float()
        if self.kind == "softmax":
            scores = torch.softmax(logits, dim=-1)
            experts = top_k_stable(scores.detach(), self.top_k)
            weights = scores.gather(1, experts)
            if self.norm_topk:
                weights = weights / weights.sum(-1, keepdim=True)
        else:
            scores = torch.sigmoid(logits)
            experts = top_k_stable(self.limit_to_groups(scores.detach() + self.expert_bias), self.top_k)
            weights = scores.gather(1, experts)
            if self.norm_topk:
                weights = weights / weights.sum(-1, keepdim=True)
        if self.scaling != 1.0:
            weights = weights * self.scaling
        if self.expert_scale is not None:
            weights = weights * self.expert_scale.float()[experts]
        return logits, scores, experts, weights

    def limit_to_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Group-limited routing (DeepSeek-V3): the experts form ``n_group`` equal groups, each scored by the
        sum of its two best ``choice`` values; a token chooses among the experts of its ``topk_group`` best
        groups (the others' choice values become -inf). Ties go to the lower group index."""
        if self.groups is None:
            return choice
        grouped = choice.view(choice.shape[0], self.groups, -1)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        chosen = top_k_stable(group_scores, self.topk_groups)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)


# ------------------------------------------------------------------------------------------- experts
def fused_grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes these operands: on CUDA in bf16 (its kernels' dtype), rows
    aligned to 16 bytes; elsewhere the loop over experts runs."""
    size = x.element_size()
    return (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16
            and x.shape[-1] * size % 16 == 0 and weight.shape[1] * size % 16 == 0)


class HostOffsets:
    """The experts' row offsets as host integers, for the loop over experts (``tensor_split`` takes host
    split points): given (an expert-parallel dispatcher has them from its split sizes), or read from the
    device ``offsets`` on first use, once for both GEMMs of the experts (on a GPU the one split-size read
    per MoE layer and micro-batch; the fused grouped GEMM never asks)."""

    def __init__(self, offsets: torch.Tensor, host: list[int] | None = None):
        self.offsets, self._host = offsets, host

    def get(self, rows: int) -> list[int]:
        """The offsets (where the device offsets hold no values, a rehearsal's fake tensors: ``rows``
        split evenly over the experts)."""
        if self._host is None:
            self._host = host_list(self.offsets, lambda: even_offsets(rows, self.offsets.shape[0]))  # the split-size read
        return self._host


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, offsets: torch.Tensor,
                   bias: torch.Tensor | None = None, fused: bool | None = None,
                   host_offsets: HostOffsets | None = None, accumulating: AccumulatingGemm | None = None) -> torch.Tensor:
    """Rows of ``x`` grouped by expert (``counts[e]`` rows for expert e, then rows of no expert: dropped
    assignments) times each expert's ``weight[e]`` ``[out, in]`` (+ ``bias[e]``). ``offsets``: the
    cumulative counts (int32). The rows of no expert come out as zeros (loop) or as something finite that
    the dispatcher masks (fused: they ride along with the last expert, so their gradient is exactly zero
    once masked, never uninitialised memory).

    ``fused`` (default :func:`fused_grouped_mm_fits`): torch's grouped GEMM, one kernel; otherwise a loop
    over the experts, the reference. ``accumulating``: the GEMM that adds the loop's weight gradients into
    the engine's fp32 accumulator (the layer's policy's)."""
    if fused is None:
        fused = fused_grouped_mm_fits(x, weight)
    rows = x.shape[0]
    if fused:
        tail = rows - offsets[-1]
        offs = torch.cat([offsets[:-1], offsets.new_full((1,), rows)])
        target = weight_grad_target(weight)
        if target is not None and target is not True:
            out = GroupedExpertGemm.apply(x, weight, offs, target)
        else:  # autograd differentiates the kernel (no engine, or compiled)
            out = torch._grouped_mm(x, weight.transpose(-2, -1), offs=offs)
        if bias is not None:
            counts = torch.cat([counts[:-1], counts[-1:] + tail])
            out = out + torch.repeat_interleave(bias, counts, dim=0, output_size=rows)
        return out
    split_points = (host_offsets or HostOffsets(offsets)).get(rows)
    target = weight_grad_target(weight)
    if target is not None and target is not True:
        out = ExpertLoopLinear.apply(x, weight, tuple(split_points), target, accumulating or AccumulatingGemm())
        if bias is None:
            return out
        rows_per_expert = torch.cat([counts, (rows - offsets[-1:]).to(counts.dtype)])  # the last: no expert
        zero = bias.new_zeros(1, bias.shape[-1])
        return out + torch.repeat_interleave(torch.cat([bias, zero]), rows_per_expert, dim=0, output_size=rows)
    parts = torch.tensor_split(x, split_points)
    outs = []
    for e in range(weight.shape[0]):  # every expert takes part, also with no rows: its gradient is zero
        outs.append(F.linear(parts[e], weight[e], None if bias is None else bias[e]))
    rest = parts[weight.shape[0]]
    outs.append(rest.new_zeros(rest.shape[0], weight.shape[1]))
    return torch.cat(outs)


class ExpertLoopLinear(torch.autograd.Function):
    """The loop over experts (rows of ``x`` split at ``split_points``, the rows after the last expert's
    coming out as zeros) whose weight gradient goes through the GEMM seam like a dense layer's: each
    expert's ``dy_e^T x_e`` added into the engine's fp32 accumulator (``target``), now or, inside a
    a zero-bubble schedule's W pass (:class:`~megand.core.tensor_parallel.wgrad.DeferredWeightGrads`).
    Used where the engine fuses the weight gradient (else autograd differentiates the loop)."""

    @staticmethod
    def forward(ctx, x, weight, split_points, target, accumulating):
        ctx.split_points, ctx.target, ctx.accumulating = split_points, target, accumulating
        ctx.save_for_backward(x, weight)
        parts = torch.tensor_split(x, split_points)
        outs = [F.linear(parts[e], weight[e]) for e in range(weight.shape[0])]
        rest = parts[weight.shape[0]]
        return torch.cat(outs + [rest.new_zeros(rest.shape[0], weight.shape[1])])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        experts = weight.shape[0]
        grads, inputs = torch.tensor_split(grad, ctx.split_points), torch.tensor_split(x, ctx.split_points)
        grad_x = None
        if ctx.needs_input_grad[0]:
            rest = inputs[experts]
            grad_x = torch.cat([grads[e].matmul(weight[e]) for e in range(experts)]
                               + [rest.new_zeros(rest.shape)])
        if ctx.needs_input_grad[1]:
            pairs, accumulating = [(grads[e], inputs[e]) for e in range(experts)], ctx.accumulating

            def add(main, overwrite):
                for e, (g, inp) in enumerate(pairs):
                    accumulating(main[e], g.t(), inp, overwrite)

            hand_over(ctx.target, add)
        return grad_x, None, None, None, None


class GroupedExpertGemm(torch.autograd.Function):
    """torch's grouped GEMM ``x_e W_e^T`` (the rows of expert e: ``offs[e-1]:offs[e]``) whose weight gradient
    goes through the GEMM seam like a dense layer's: one grouped GEMM ``dy_e^T x_e`` for every expert, added
    into the engine's fp32 accumulator (``target``) now or, inside a
    a zero-bubble schedule's W pass (:class:`~megand.core.tensor_parallel.wgrad.DeferredWeightGrads`).

    The operand layouts are the ones the kernel takes without further conditions: the input gradient
    ``dy W_e`` reads ``W [E, out, in]`` row-major; the weight gradient reads ``dy^T`` column-major and ``x``
    row-major, the layout in which the kernel accepts an expert with no rows and any row count (with
    ``dy^T`` row-major it needs each expert's rows a multiple of 16 bytes). The kernel's product comes
    out in the operands' dtype (bf16 on CUDA: its kernels return no fp32), then is added at fp32."""

    @staticmethod
    def forward(ctx, x, weight, offs, target):
        ctx.target = target
        x = x.contiguous()
        ctx.save_for_backward(x, weight, offs)
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offs)

    @staticmethod
    def backward(ctx, grad):
        x, weight, offs = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = torch._grouped_mm(grad, weight, offs=offs) if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            hand_over(ctx.target, lambda main, overwrite: add_product(main, torch._grouped_mm(grad.t(), x, offs=offs),
                                                                      overwrite))
        return grad_x, None, None, None


class GroupedLinear(torch.nn.Module):
    """The weights of one linear layer of every local expert, ``[E, out, in]``; ``split_dim`` (1 or 2)
    is the dim split over tp (None: whole experts)."""

    def __init__(self, num_experts, in_features, out_features, *, bias, split_dim, topo, init_std,
                 sharded_tokens, bias_split, dtype, device):
        super().__init__()
        tp_size, tp_rank = (topo.tp_size, topo.tp_rank)
        # expert parallelism: this rank holds experts [ep_rank * E/ep, (ep_rank + 1) * E/ep) of dim 0
        ep = dict(expert=True, ep_rank=getattr(topo, "ep_rank", 0), ep_size=getattr(topo, "ep_size", 1))
        local_experts = num_experts // ep["ep_size"]
        full = (num_experts, out_features, in_features)
        local = tuple(n // tp_size if d == split_dim else n for d, n in enumerate(full))
        local = (local_experts,) + local[1:]
        self.weight = _param(local, ParamMeta(full, split_dim, tp_rank, tp_size, init_std=init_std,
                                              input_split=split_by_tokens(split_dim is None and sharded_tokens),
                                              role=EXPERT_MATRIX, **ep),
                             dtype, device)
        self.bias = None
        if bias:
            full_b = (num_experts, out_features)
            split_b = 1 if bias_split else None
            local_b = (local_experts, out_features // tp_size if bias_split else out_features)
            self.bias = _param(local_b, ParamMeta(full_b, split_b, tp_rank, tp_size, init="zeros", **ep,
                                                  input_split=split_by_tokens(split_b is None and sharded_tokens), role=BIAS),
                               dtype, device)
        self.split_dim, self.tp_group = split_dim, getattr(topo, "tp_group", None)
        self.set_gemm(DEFAULT)

    def set_gemm(self, policy: GemmPolicy):
        """Run the experts' products under ``policy`` (a precision recipe); the default runs
        :func:`grouped_linear`."""
        self.gemm = use_policy(self.weight, policy.bind(self.tp_group, {None: None, 1: "column", 2: "row"}[self.split_dim]))

    def forward(self, x, counts, offsets, add_bias=True, host_offsets=None):
        bias = self.bias if add_bias else None
        out = self.gemm.grouped(x, self.weight, counts, offsets, bias)
        if out is not None:
            return out
        return grouped_linear(x, self.weight, counts, offsets, bias, host_offsets=host_offsets,
                              accumulating=self.gemm.accumulating)


class Experts(torch.nn.Module):
    """The routed experts: ``fc1 [E, f (x2 for swiglu, rows interleaved gate/up), h]``, ``fc2 [E, h, f]``."""

    def __init__(self, cfg, topo, split: bool, sharded_tokens: bool, device):
        super().__init__()
        self.swiglu, self.geglu = cfg.activation == "swiglu", cfg.activation == "geglu"
        self.clamp = (cfg.swiglu_alpha, cfg.swiglu_limit) if cfg.swiglu_limit is not None else None
        f, h, e = cfg.expert_ffn_hidden_size, cfg.hidden_size, cfg.num_experts
        common = dict(bias=cfg.add_bias or cfg.moe_bias, topo=topo, sharded_tokens=sharded_tokens, dtype=cfg.params_dtype,
                      device=device)
        self.fc1 = GroupedLinear(e, h, f * (2 if self.swiglu or self.geglu else 1), split_dim=1 if split else None,
                                 init_std=cfg.init_std, bias_split=split, **common)
        if self.swiglu or self.geglu:  # rows alternate gate, up
            retag(self.fc1.weight, fused_rows=(1, 1))
        # split over tp, fc2's bias is added once after the tp reduction (by the MoE block)
        self.fc2 = GroupedLinear(e, f, h, split_dim=2 if split else None,
                                 init_std=cfg.init_std / (2 * cfg.num_layers) ** 0.5, bias_split=False, **common)

    def forward(self, x, counts, offsets, fc2_bias=True, host_offsets: list[int] | None = None):
        """``host_offsets``: the offsets as host integers where the caller has them (else read once, if
        the loop over experts runs)."""
        host = HostOffsets(offsets, host_offsets)  # shared by both GEMMs
        h = self.fc1(x, counts, offsets, host_offsets=host)
        if self.clamp is not None:
            h = clamped_swiglu(h.unflatten(-1, (-1, 2)), *self.clamp)
        elif self.geglu:  # [..., f, 2]: gate, up (the dense MLP's GeGLU)
            pairs = h.unflatten(-1, (-1, 2))
            h = F.gelu(pairs[..., 0], approximate="tanh") * pairs[..., 1]
        else:
            h = SwiGLU.apply(h.unflatten(-1, (-1, 2))) if self.swiglu else F.gelu(h, approximate="tanh")
        return self.fc2(h, counts, offsets, add_bias=fc2_bias, host_offsets=host)


class LocalDispatcher:
    """Token dispatch at expert-parallel size 1: every expert is local.

    A dispatcher is called as ``dispatcher(tokens, experts, weights, keep, local_experts)`` and returns the
    routed output ``[T, h]``. Here: ``permute`` orders the assignments by expert (stable: token order within
    an expert; dropped assignments last), ``local_experts(tokens, counts, offsets)`` runs the grouped GEMM,
    ``unpermute`` puts the outputs back in assignment order and sums each token's k outputs times their
    weights. An expert-parallel dispatcher sends the permuted tokens to the ranks owning their experts (and
    the outputs back) around ``local_experts``."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def __call__(self, tokens, experts, weights, keep, local_experts):
        permuted, counts, offsets, order = self.permute(tokens, experts, keep)
        return self.unpermute(local_experts(permuted, counts, offsets), order, weights, keep)

    def permute(self, x, experts, keep):
        """``x [T, h]``, ``experts [T, k]``, ``keep [T, k]`` bool or None -> ``(tokens [T*k, h] grouped by
        expert, counts [E], offsets [E] int32, state for unpermute)``."""
        k = experts.shape[1]
        flat = experts.reshape(-1)
        if keep is not None:
            flat = torch.where(keep.reshape(-1), flat, torch.full_like(flat, self.num_experts))
        order = torch.sort(flat, stable=True).indices
        counts = count_per_expert(flat, self.num_experts + 1)[: self.num_experts]
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        return x[order // k], counts, offsets, order

    def unpermute(self, out, order, weights, keep):
        """``out [T*k, h]`` in expert order -> ``[T, h]``: each token's outputs weighted and summed (in a
        fixed order: deterministic on every device)."""
        t, k = weights.shape
        back = torch.empty_like(out)
        back[order] = out
        if keep is not None:  # dropped assignments: no output, no gradient
            back = back.masked_fill(~keep.view(-1, 1), 0.0)
        w = weights if keep is None else weights.masked_fill(~keep, 0.0)
        return weighted_sum(back.view(t, k, -1), w)


class SharedExperts(MLP):
    """The always-on experts: the dense MLP at width ``moe_shared_experts * f``, optionally gated by
    ``sigmoid(x @ gate.T)`` (``gate [1, h]``, replicated over tp)."""

    def __init__(self, cfg, topo, device):
        width = cfg.moe_shared_experts * cfg.expert_ffn_hidden_size
        super().__init__(dataclasses.replace(cfg, ffn_hidden_size=width), topo, device)
        self.gate = None
        if cfg.moe_shared_expert_gate:
            self.gate = GateWeight(cfg, topo, device)

    def forward(self, x):
        y = super().forward(x)
        return y if self.gate is None else y * torch.sigmoid(self.gate(x))


class GateWeight(torch.nn.Module):
    def __init__(self, cfg, topo, device):
        super().__init__()
        shape = (1, cfg.hidden_size)
        self.weight = _param(shape, ParamMeta(shape, None, topo.tp_rank, topo.tp_size, init_std=cfg.init_std,
                                              input_split=split_by_tokens(cfg.sequence_parallel), role=ROUTER),
                             cfg.params_dtype, device)

    def forward(self, x):
        return F.linear(x, self.weight)


# ------------------------------------------------------------------------------------------- losses
class AddLossGradient(torch.autograd.Function):
    """Identity on ``out``; backward also sends ``scale`` as the gradient of ``loss``: adds ``loss`` to the
    training objective from inside the model, whatever stage the layer is on (Megatron's aux-loss scaler)."""

    @staticmethod
    def forward(ctx, out, loss, scale):
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None




def in_recompute() -> bool:
    """Whether this forward is activation recomputation (it runs inside a backward): its statistics were
    already counted by the original forward."""
    return torch._C._current_graph_task_id() != -1


class MoEStats:
    """One MoE layer's statistics over a training step, on the device (read only when logged).

    ``load [E]``: assignments per expert summed over the step's micro-batches and every rank of the
    micro-batch (identical on those ranks); ``aux``/``z``: sums of the unweighted losses; ``dropped``:
    assignments this rank dropped for capacity, counted once per tp group when its tp ranks apply the
    capacity to the same tokens."""

    def __init__(self, num_experts, device):
        self.load = torch.zeros(num_experts, dtype=torch.float32, device=device)
        self.aux = torch.zeros((), dtype=torch.float32, device=device)
        self.z = torch.zeros((), dtype=torch.float32, device=device)
        self.dropped = torch.zeros((), dtype=torch.float32, device=device)
        self.microbatches = 0  # a host count

    def reset(self):
        for t in (self.load, self.aux, self.z, self.dropped):
            t.zero_()
        self.microbatches = 0


class MoE(torch.nn.Module):
    """The MoE block in place of a layer's MLP: ``mlp.router``, ``mlp.experts``, ``mlp.shared_experts``."""

    def __init__(self, cfg, topo, device=None):
        super().__init__()
        device = topo.device if device is None else device
        if cfg.activation not in ("gelu", "swiglu", "geglu"):
            raise ValueError(f"model.activation={cfg.activation!r}: expected gelu, swiglu or geglu")
        self.cfg, self.topo = cfg, topo
        tp = topo.tp_size
        self.split_experts = cfg.expert_tensor_parallel and tp > 1
        # the tokens this rank routes are its own share of the tp group's (sp shard, or etp=1 split)
        self.sharded_tokens = tp > 1 and (cfg.sequence_parallel or not cfg.expert_tensor_parallel)
        self.router = Router(cfg, topo, self.sharded_tokens, device)
        self.experts = Experts(cfg, topo, self.split_experts, self.sharded_tokens, device)
        self.shared_experts = SharedExperts(cfg, topo, device) if cfg.moe_shared_experts else None
        # expert parallelism with experts split over tp and sequence-parallel tokens: Megatron's order, the
        # exchange on the sequence shard and the tp gather after it (inside the dispatcher)
        self.gather_after_exchange = getattr(topo, "ep_size", 1) > 1 and self.split_experts and cfg.sequence_parallel
        if getattr(topo, "ep_size", 1) > 1:
            over_tp = (dict(tp_group=topo.etp_group, tp_size=topo.etp_size, tp_rank=topo.etp_rank,
                            tp_ep_group=topo.expert_tp_ep_group) if self.gather_after_exchange else {})
            self.dispatcher = AllToAllDispatcher(cfg.num_experts, topo.ep_group, topo.ep_size, topo.ep_rank, **over_tp)
        else:
            self.dispatcher = LocalDispatcher(cfg.num_experts)
        self.stats = MoEStats(cfg.num_experts, topo.device)
        self.loss_scale = 1.0  # gradient of the balancing losses: loss scale / micro-batches of the step
        # experts split over tp apply the capacity to the tp group's tokens, identically on every tp rank:
        # one of them counts the drops
        self.counts_dropped = not self.split_experts or topo.tp_rank == 0
        self.attach_loss = AddLossGradient.apply

    def keep_eager(self, eager) -> None:
        """This block is compiled: :class:`AddLossGradient` runs through ``eager`` (``torch.compiler.disable``:
        the compiled caller breaks its graph there). Traced, torch 2.13 drops the gradient it sends to
        ``loss`` (an input its forward does not use) and the balancing losses silently stop training the
        router."""
        self.attach_loss = eager(AddLossGradient.apply)

    def borrowed_parameters(self):
        """fc2's bias, added here after the tp reduction when the experts are split over tp."""
        b = self.experts.fc2.bias
        return [b] if self.split_experts and b is not None else []

    def forward(self, x, route_from=None):
        """``x [s, b, h]``: the experts' input; ``route_from``: what the router reads, when not ``x`` (Gemma 4's
        router reads the residual, its experts a norm of it)."""
        cfg, topo = self.cfg, self.topo
        split_here = not cfg.expert_tensor_parallel and topo.tp_size > 1 and not cfg.sequence_parallel
        local = scatter_to_sp(x, topo.tp_group) if split_here else x  # [s', b, h]: the tokens routed here
        route = local if route_from is None else scatter_to_sp(route_from, topo.tp_group) if split_here else route_from
        s, b, h = local.shape
        logits, scores, experts, weights = self.router(route.reshape(s * b, h))

        balancing_loss = self._balance(logits, scores, experts)
        out = self._routed(local, experts, scores, weights)
        if self.training and torch.is_grad_enabled() and (cfg.moe_aux_loss_coeff or cfg.moe_z_loss_coeff):
            out = self.attach_loss(out, balancing_loss, self.loss_scale)
        out = out.view(s, b, h)
        if split_here:
            out = gather_from_sp(out, topo.tp_group, to_model_parallel=False)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _routed(self, local, experts, scores, weights):
        """The routed experts' output for the local tokens ``[T, h]``."""
        cfg, topo = self.cfg, self.topo
        s, b, h = local.shape
        keep_local = None
        if not self.split_experts:
            tokens, keep = local.reshape(s * b, h), self._keep(experts, scores)
            out = self._experts(tokens, experts, weights, keep, fc2_bias=True)
            return out
        # experts split over tp: every tp rank processes the tp group's tokens, partial sums reduced
        if self.gather_after_exchange:  # the dispatcher gathers over tp and reduce-scatters back
            if cfg.moe_capacity_factor is not None:  # the capacity rule of the tp group's tokens, as below
                all_experts = gather_from_sp(experts.view(s, b, -1), topo.tp_group).reshape(-1, experts.shape[1])
                all_scores = gather_from_sp(scores.detach().view(s, b, -1), topo.tp_group).reshape(-1, scores.shape[1])
                keep = self._keep(all_experts, all_scores)
                keep_local = keep.view(-1, b, keep.shape[1]).chunk(topo.tp_size)[topo.tp_rank].reshape(s * b, -1)
            out = self._experts(local.reshape(s * b, h), experts, weights, keep_local, fc2_bias=False)
        elif cfg.sequence_parallel:
            full = gather_from_sp(local, topo.tp_group)  # backward: reduce-scatter of the partial input grads
            all_experts = gather_from_sp(experts.view(s, b, -1), topo.tp_group).reshape(-1, experts.shape[1])
            all_scores = gather_from_sp(scores.detach().view(s, b, -1), topo.tp_group).reshape(-1, scores.shape[1])
            all_weights = gather_from_sp(weights.view(s, b, -1), topo.tp_group).reshape(-1, weights.shape[1])
            keep = self._keep(all_experts, all_scores)
            partial = self._experts(full.reshape(-1, h), all_experts, all_weights, keep, fc2_bias=False)
            out = reduce_scatter_to_sp(partial.view(-1, b, h), topo.tp_group).reshape(s * b, h)
            if keep is not None:
                keep_local = keep.view(-1, b, keep.shape[1]).chunk(topo.tp_size)[topo.tp_rank].reshape(s * b, -1)
        else:
            keep_local = self._keep(experts, scores)
            # both enter tp-partial products: their gradients are partial on each tp rank, summed by copy_to_tp
            tokens = copy_to_tp(local.reshape(s * b, h), topo.tp_group)
            partial = self._experts(tokens, experts, copy_to_tp(weights, topo.tp_group), keep_local, fc2_bias=False)
            out = reduce_from_tp(partial, topo.tp_group)
        bias = self.experts.fc2.bias
        if bias is not None:  # sum_k w_k b2[e_k] once, after the reduction
            w = weights if keep_local is None else weights.masked_fill(~keep_local, 0.0)
            out = out + (bias[experts].float() * w.unsqueeze(-1)).sum(1).to(out.dtype)
        return out

    def _experts(self, tokens, experts, weights, keep, fc2_bias):
        return self.dispatcher(tokens, experts, weights, keep, functools.partial(self.experts, fc2_bias=fc2_bias))

    def _keep(self, experts, scores):
        """The capacity mask of the assignments routed here (None: dropless); counts the drops."""
        cf = self.cfg.moe_capacity_factor
        if cf is None:
            return None
        capacity = capacity_of(cf, experts.shape[0], self.cfg.moe_top_k, self.cfg.num_experts)
        keep = capacity_keep(experts, scores.detach().gather(1, experts), self.cfg.num_experts, capacity)
        if self.training and self.counts_dropped and not in_recompute():
            self.stats.dropped += (~keep).sum()
        return keep

    def _balance(self, logits, scores, experts):
        """The micro-batch's aux loss and z-loss over its global tokens, weighted by their coefficients
        (returned), and the step statistics."""
        cfg, topo = self.cfg, self.topo
        e, k = cfg.num_experts, cfg.moe_top_k
        counts = count_per_expert(experts.reshape(-1), e).float()
        lse2 = torch.logsumexp(logits, dim=-1).square().sum().unsqueeze(0)
        sums = torch.cat([counts, scores.sum(0), lse2])
        if self.sharded_tokens:
            sums = reduce_from_tp(sums, topo.tp_group)  # forward all-reduce, backward identity
        # the micro-batch's ranks: every replica's micro-batch of this index, or one replica's under uneven
        # batch shares (megand/core/batch_shares.py)
        sums = reduce_from_tp(sums, topo.microbatch_group)
        tokens = scores.shape[0] * (topo.tp_size if self.sharded_tokens else 1) * topo.microbatch_ranks
        load, score_sum = sums[:e].detach(), sums[e: 2 * e]
        aux = e * ((load / (k * tokens)) * (score_sum / tokens)).sum()
        z = sums[2 * e] / tokens
        if self.training and not in_recompute():
            st = self.stats
            st.load += load
            st.aux += aux.detach()
            st.z += z.detach()
            st.microbatches += 1
        return cfg.moe_aux_loss_coeff * aux + cfg.moe_z_loss_coeff * z


# ------------------------------------------------------------------------------- step-level helpers
def moe_layers(chunks) -> list[MoE]:
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, MoE)]


def start_step(chunks, loss_scale: float, num_microbatches: int) -> None:
    """Before a step's forward/backward: zero the statistics and set the balancing losses' gradient scale
    (each micro-batch's losses count 1/num_microbatches, like its share of the LM loss; times the fp16
    loss scale)."""
    for m in moe_layers(chunks):
        m.stats.reset()
        m.loss_scale = float(loss_scale) / num_microbatches


@torch.no_grad()
def update_expert_bias(chunks) -> None:
    """After an optimizer step: the auxiliary-loss-free balancing step of every sigmoid router,
    ``bias_e += rate * sign(mean load - load_e)`` from the loads of the whole step (identical on every
    rank that holds the layer: the loads are already summed over the micro-batch's ranks; under uneven
    batch shares each replica's over its own micro-batches, summed here over the replicas)."""
    for m in moe_layers(chunks):
        rate = m.cfg.moe_bias_update_rate
        if m.router.expert_bias is not None and rate > 0 and m.stats.microbatches:
            load = m.stats.load
            if m.topo.layout.uneven_shares:
                load = load.clone()
                torch.distributed.all_reduce(load, group=m.topo.dp_group)
            m.router.expert_bias += rate * torch.sign(load.mean() - load)


def step_metrics(chunks, cfg, device) -> list[Metric]:
    """The MoE statistics of this rank's layers over the last step, by name (none for a dense ``cfg``),
    device values. Summed over ranks, the aux and z sums over the terms (layers x micro-batches) are the
    means over layers and micro-batches (every rank of a stage holds the same values, and every stage the
    same number of ranks); the load ratio is maxed and, under a capacity factor, the drops summed."""
    if cfg.num_experts is None:
        return []
    aux, z, ratio, dropped = (torch.zeros((), dtype=torch.float64, device=device) for _ in range(4))
    terms = 0
    for m in moe_layers(chunks):
        st = m.stats
        aux += st.aux.double()
        z += st.z.double()
        terms += st.microbatches
        mean = st.load.mean()
        ratio = torch.maximum(ratio, torch.where(mean > 0, st.load.max() / mean.clamp_min(1e-30),
                                                 torch.zeros_like(mean)).double())
        dropped += st.dropped.double()
    metrics = [Metric("aux_loss", aux, MEAN, count=terms), Metric("z_loss", z, MEAN, count=terms),
               Metric("expert_load_max_over_mean", ratio, MAX)]
    if cfg.moe_capacity_factor is not None:
        metrics.append(Metric("tokens_dropped", dropped, SUM, integer=True))
    return metrics
