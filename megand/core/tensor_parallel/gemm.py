"""The GEMM seam: every product of the parallel linear layers (column, row, sequence-parallel, the SwiGLU
fc1) and of the routed experts goes through one :class:`GemmPolicy`, so that a precision recipe, the fp32
weight-gradient fusion and the deferral of the weight-gradient pass are each written once.

A linear layer ``y = x W^T`` has three products, on 2-D operands (tokens flattened):

- forward ``y = x W^T`` (:meth:`GemmPolicy.forward`),
- B, the input gradient ``dx = dy W`` (:meth:`GemmPolicy.input_grad`),
- W, the weight gradient ``dW = dy^T x`` (:meth:`GemmPolicy.weight_grad`, or
  :meth:`GemmPolicy.add_weight_grad` into an fp32 accumulator).

The layers call :func:`weight_grad_pass` for W: it adds the product into the data-parallel engine's fp32
accumulator (now, or queued in a :class:`~megand.core.tensor_parallel.wgrad.DeferredWeightGrads` while
the engine's sink defers: a zero-bubble schedule's split of backward into B and W), or returns it for
autograd.
Sequence-parallel layers gather their input through :meth:`GemmPolicy.gather_input`, so a recipe may
gather in its own format (FP8 bytes with their scales).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megand.core.tensor_parallel.mappings import _gather_first
from megand.core.tensor_parallel.wgrad import COMPILED_FUSION, AccumulatingGemm, fused_accumulator, hand_over


class GemmPolicy:
    """The products of the operands' own dtype (fp32, bf16 or fp16), accumulated at fp32 where the
    engine fuses the weight gradient. A recipe (:mod:`.fp8`) subclasses it and overrides the products.

    ``group`` and ``split`` say how the layer's weight is split over tensor parallelism (``"column"``: its
    rows, ``"row"``: its columns, None: not split); a recipe whose scales must not depend on the layout
    agrees them over ``group``. ``accumulating``: the fp32-accumulating GEMM (and its one probe of the
    device), shared by the policies bound from one template."""

    name = None  # the recipe's name; None: the operands' dtype

    def __init__(self, group=None, split: str | None = None, accumulating: AccumulatingGemm | None = None):
        self.group, self.split = group, split
        self.accumulating = accumulating or AccumulatingGemm()

    def __repr__(self):
        return f"{type(self).__name__}(split={self.split!r})"

    def bind(self, group, split):
        """This policy for a layer of the given tp group and split (the layers bind a shared policy)."""
        return type(self)(group, split, self.accumulating)

    # -- communication ----------------------------------------------------------------------------
    def gather_input(self, x: torch.Tensor, group):
        """Sequence parallelism: ``x``, this rank's sequence shard, gathered over the tp ``group`` along
        dim 0, as the 2-D operand :meth:`forward` takes."""
        return _gather_first(x, group).reshape(-1, x.shape[-1])

    def regather_input(self, x: torch.Tensor, group):
        """Backward of a sequence-parallel layer: ``x`` gathered again, as the 2-D operand of the weight
        gradient (:meth:`weight_grad`, :meth:`add_weight_grad`)."""
        return _gather_first(x, group).reshape(-1, x.shape[-1])

    def input_operand(self, x: torch.Tensor):
        """The operand :meth:`forward` takes for a 2-D input ``x [m, k]`` (a recipe quantises it once for
        the products that share it)."""
        return x

    # -- the three products (2-D operands) ---------------------------------------------------------
    def forward(self, x, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x W^T (+ b)`` ``[m, n]`` from ``x [m, k]`` (or what :meth:`gather_input` returned) and ``W [n, k]``."""
        return F.linear(x, weight, bias)

    def forward_parts(self, x, weight: torch.Tensor, bias: torch.Tensor | None, parts: int) -> list[torch.Tensor]:
        """The forward of each part of ``weight``'s interleaved rows (row ``r`` in part ``r % parts``: the
        SwiGLU fc1's gate and up), ``[x W_p^T (+ b_p)]``: strided views of the rows, no copy (a matrix whose
        rows are ``parts * k`` apart is still a valid GEMM operand)."""
        rows = weight.view(-1, parts, weight.shape[-1])
        biases = bias.view(-1, parts) if bias is not None else None
        return [self.forward(x, rows[:, p], None if biases is None else biases[:, p]) for p in range(parts)]

    def input_grad(self, grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``dy W`` ``[m, k]``."""
        return grad.matmul(weight)

    def weight_grad(self, grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``dy^T x`` ``[n, k]`` in the operands' dtype (autograd's ``p.grad``)."""
        return grad.t().matmul(x)

    def add_weight_grad(self, main: torch.Tensor, grad: torch.Tensor, x: torch.Tensor, overwrite: bool = False) -> None:
        """``main += dy^T x`` at ``main``'s precision (the engine's fp32 accumulator); ``overwrite``: ``main = dy^T x``."""
        self.accumulating(main, grad.t(), x, overwrite)

    # -- the routed experts ------------------------------------------------------------------------
    def grouped(self, x, weight, counts, offsets, bias=None):
        """Rows of ``x`` grouped by expert times each expert's ``weight[e] [out, in]``; None: the
        experts' own grouped GEMM runs (the operands' dtype needs nothing else)."""
        return None


def use_policy(weight: torch.Tensor, policy: GemmPolicy) -> GemmPolicy:
    """``policy``, now the one that runs ``weight``'s products; the weight names it too
    (``weight.gemm_policy``), which is how a compiled backward's W pass finds it at run time."""
    weight.gemm_policy = policy
    return policy


def weight_grad_target(weight: torch.Tensor, fuse: bool = True):
    """Where the layer's W pass goes, decided in forward (which holds the parameter itself: backward
    unpacks a detached copy under activation recompute, and a traced one under torch.compile): the
    engine's ``accumulate_grad`` (eager), True (compiled: :func:`weight_grad_op` finds it at run time),
    or None (autograd's gradient: no engine, or ``fuse`` off)."""
    accumulate = fused_accumulator(weight, fuse)
    if accumulate is None:
        return None
    if torch.compiler.is_compiling():
        return True if COMPILED_FUSION else None
    return accumulate


def weight_grad_pass(policy: GemmPolicy, weight: torch.Tensor, grad: torch.Tensor, x, target) -> torch.Tensor | None:
    """The W pass of one layer: ``dy^T x`` added into the engine's fp32 accumulator (``target`` from
    :func:`weight_grad_target`; now or, while its sink defers, later) and None returned, or
    returned as autograd's gradient (``target`` None)."""
    if target is None:
        return policy.weight_grad(grad, x)
    if target is True:  # compiled: x is a tensor here (a recipe gathers high precision when compiled)
        torch.ops.megand.weight_grad_pass(weight, grad, x)
    else:
        hand_over(target, lambda main, overwrite: policy.add_weight_grad(main, grad, x, overwrite))
    return None


DEFAULT = GemmPolicy()
