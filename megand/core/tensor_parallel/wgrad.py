"""Weight gradients added straight into the data-parallel engine's fp32 accumulator (Megatron's
gradient-accumulation fusion), now, later (a deferred W pass), or from inside a compiled backward.

Left to autograd, a layer's weight gradient is first made as ``p.grad`` in the parameter's dtype and then
added by the engine's hook into the fp32 ``main_grad``: in a bf16 model every micro-batch's gradient is
rounded to bf16 before it is summed, and a full-size gradient tensor is written and read once more. A
layer that computes its own weight gradient instead hands the product to ``p.accumulate_grad`` (set by the
engine), which adds it into the accumulator at fp32.

Under torch.compile the hand-over is an opaque operator with an ordered side effect (:func:`weight_grad_op`):
the compiled backward keeps it (no dead-code elimination, no reordering past another hand-over) and it runs
the same Python at run time, so a compiled layer fuses as the eager one does.
"""

import contextlib
import itertools
import weakref

import torch

# torch.addmm(..., out_dtype=, out=): a bf16 GEMM accumulating into an fp32 matrix in place (beta = 1)
_ADDMM_OUT_DTYPE = "dtype_out" in torch.ops.aten.addmm.overloads()


def fused_accumulator(weight: torch.Tensor, fuse: bool = True):
    """The engine's ``accumulate_grad`` of ``weight``, or None where autograd's ``p.grad`` path is used: no
    engine, or ``fuse`` off (a weight read twice in one backward: its gradient arrives once, summed)."""
    if not fuse:
        return None
    return getattr(weight, "accumulate_grad", None)


def add_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b`` at ``out``'s precision, in one accumulating GEMM: on CUDA a bf16 GEMM whose fp32
    result is added in place by the GEMM itself (no product-sized temporary); on CPU (whose bf16 GEMM
    rounds its result to bf16) an fp32 GEMM of the operands, converted. Errors (out of memory included)
    propagate: there is no silent switch to a product rounded to bf16."""
    if a.dtype == out.dtype:
        out.addmm_(a, b)
    elif out.is_cuda and _ADDMM_OUT_DTYPE:
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    elif out.is_cuda:  # a torch without the accumulating overload: the product rounded as p.grad would be
        out.add_(torch.mm(a, b))
    else:
        out.addmm_(a.to(out.dtype), b.to(out.dtype))


# ------------------------------------------------------------------------------- deferred W passes
_deferral: list["DeferredWeightGrads"] = []


class DeferredWeightGrads:
    """A context in which the fused weight-gradient products (the W pass) of the layers are queued
    instead of run; :meth:`run` runs them, in the order they arrived. A zero-bubble pipeline schedule runs
    a micro-batch's backward inside one (B: input gradients only) and calls :meth:`run` where the schedule
    places W. A weight whose gradient autograd returns (no engine, or not fused) is not deferred: its
    product runs in B. Each queued pass holds its two operands until it runs."""

    def __init__(self):
        self.passes = []

    def __enter__(self):
        _deferral.append(self)
        return self

    def __exit__(self, *exc):
        _deferral.remove(self)

    def __len__(self):
        return len(self.passes)

    def run(self) -> int:
        """Run the queued passes (each adds into its weight's accumulator); returns how many ran. Outside
        autograd's backward, so without grad mode as inside it (the accumulators are views made
        without it, which grad mode forbids modifying in place)."""
        passes, self.passes = self.passes, []
        with torch.no_grad():
            for accumulate, add in passes:
                accumulate(add)
        return len(passes)


def hand_over(accumulate, add) -> None:
    """Give ``add(main)`` to the engine's accumulator now, or queue it when a W pass is being deferred."""
    if _deferral:
        _deferral[-1].passes.append((accumulate, add))
    else:
        accumulate(add)


# ----------------------------------------------------------------------------- under torch.compile
# the policies a compiled hand-over names by number (an operator takes no Python objects)
_policies = weakref.WeakValueDictionary()
_numbers = itertools.count()


def register_policy(policy) -> int:
    number = next(_numbers)
    _policies[number] = policy
    return number


@torch.library.custom_op("megand::weight_grad_pass", mutates_args=())
def weight_grad_op(weight: torch.Tensor, grad: torch.Tensor, x: torch.Tensor, policy: int) -> None:
    """Run time of a compiled backward's W pass: ``weight.accumulate_grad`` gets ``main += grad^T x`` (the
    policy's product), exactly as in eager mode. Only called where the layer decided to fuse."""
    gemm = _policies[policy]
    if _deferral:  # queued past this call: the compiled graph may reuse its buffers once the op returns
        grad, x = grad.clone(), x.clone()
    hand_over(weight.accumulate_grad, lambda main: gemm.add_weight_grad(main, grad, x))


@weight_grad_op.register_fake
def _(weight, grad, x, policy):
    return None


def _mark_ordered_effect() -> bool:
    """Declare the operator side-effecting, so a compiled backward keeps it and in order (torch's effect
    tokens; the private registration is the only spelling of it in torch 2.x)."""
    register = getattr(torch.library, "_register_effectful_op", None)
    if register is None:
        return False
    from torch._higher_order_ops.effects import _EffectType

    with contextlib.suppress(RuntimeError):  # already registered (a module reloaded)
        register(torch.ops.megand.weight_grad_pass.default, _EffectType.ORDERED)
    return True


COMPILED_FUSION = _mark_ordered_effect()
