"""Weight gradients added straight into the data-parallel engine's fp32 accumulator (Megatron's
gradient-accumulation fusion), now, later (a deferred W pass), or from inside a compiled backward.

Left to autograd, a layer's weight gradient is first made as ``p.grad`` in the parameter's dtype and then
added by the engine's hook into the fp32 ``main_grad``: in a bf16 model every micro-batch's gradient is
rounded to bf16 before it is summed, and a full-size gradient tensor is written and read once more. A
layer that computes its own weight gradient instead hands the product to ``p.accumulate_grad`` (an
:class:`Accumulator` the engine gives each of its parameters), which adds it into the accumulator at fp32.

Deferral belongs to whoever runs the backward: a zero-bubble schedule runs a micro-batch's input-gradient
pass inside :meth:`WeightGradSink.deferring` of the engine's sink, with a :class:`DeferredWeightGrads` of
its own that it runs later as the W pass. Nothing here is process-wide.

Under torch.compile the hand-over is an opaque operator with an ordered side effect (:func:`weight_grad_op`):
the compiled backward keeps it (no dead-code elimination, no reordering past another hand-over) and it runs
the same Python at run time, so a compiled layer fuses as the eager one does. Its only arguments are
tensors: the weight names its own policy (``weight.gemm_policy``), so every layer runs the same graph.
"""

import contextlib

import torch


class AccumulatingGemm:
    """``out += a @ b`` at ``out``'s precision. On CUDA, one accumulating GEMM: a bf16 GEMM whose fp32
    result is added in place by the GEMM itself (``torch.addmm(out_dtype=, out=)``, no product-sized
    temporary), where the device's kernel takes it: torch 2.8-2.9's CUDA kernel refuses an fp32 ``out``
    with bf16 operands (2.10 takes it), so it is probed once per device type and dtypes and the answer
    kept here (:attr:`takes`). Elsewhere, and where the probe says no, an fp32 GEMM of the operands
    converted to ``out``'s dtype: the same fp32-accumulated product of the same values (on CPU the bf16
    GEMM would round its result to bf16). Errors of the product itself (out of memory included)
    propagate: there is no silent switch to a product rounded to bf16."""

    def __init__(self):
        self.takes: dict[tuple, bool] = {}  # (device type, operand dtype, out dtype) -> the probe's answer

    def takes_out_dtype(self, out: torch.Tensor, a: torch.Tensor) -> bool:
        """Whether ``addmm(out_dtype=out.dtype, out=out)`` on operands of ``a``'s dtype runs on ``out``'s
        device (CUDA only; probed on first use)."""
        if not out.is_cuda:
            return False
        key = (out.device.type, a.dtype, out.dtype)
        if key not in self.takes:
            self.takes[key] = self.probe(out, a)
        return self.takes[key]

    @staticmethod
    def probe(out: torch.Tensor, a: torch.Tensor) -> bool:
        """One 2 x 2 accumulating GEMM on ``out``'s device: whether this torch's kernel takes it."""
        if "dtype_out" not in torch.ops.aten.addmm.overloads():
            return False
        small = torch.zeros(2, 2, dtype=out.dtype, device=out.device)
        operand = torch.ones(2, 2, dtype=a.dtype, device=out.device)
        try:
            with torch.no_grad():
                torch.addmm(small, operand, operand, out_dtype=out.dtype, out=small)
        except RuntimeError:  # the kernel refuses the dtypes (NotImplementedError is one too)
            return False
        return True

    def __call__(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, overwrite: bool = False) -> None:
        """``out += a @ b``; ``overwrite``: ``out = a @ b`` (``out``'s contents are not read: beta 0)."""
        beta = 0 if overwrite else 1
        if a.dtype == out.dtype:
            out.addmm_(a, b, beta=beta)
        elif self.takes_out_dtype(out, a):
            torch.addmm(out, a, b, beta=beta, out_dtype=out.dtype, out=out)
        else:
            out.addmm_(a.to(out.dtype), b.to(out.dtype), beta=beta)


def add_product(main: torch.Tensor, product: torch.Tensor, overwrite: bool) -> None:
    """``main += product`` at ``main``'s precision, or ``main = product`` where ``overwrite`` (see :class:`Accumulator`)."""
    if overwrite:
        main.copy_(product)
    else:
        main.add_(product)


def fused_accumulator(weight: torch.Tensor, fuse: bool = True):
    """The engine's ``accumulate_grad`` of ``weight``, or None where autograd's ``p.grad`` path is used: no
    engine, or ``fuse`` off (a weight read twice in one backward: its gradient arrives once, summed)."""
    if not fuse:
        return None
    return getattr(weight, "accumulate_grad", None)


# ------------------------------------------------------------------------------- deferred W passes
class DeferredWeightGrads:
    """The fused weight-gradient products (the W pass) of one input-gradient pass, queued instead of run
    (see :meth:`WeightGradSink.deferring`); :meth:`run` runs them, in the order they arrived. A zero-bubble
    pipeline schedule makes one per split backward and calls :meth:`run` where the schedule places W. A
    weight whose gradient autograd returns (no engine, or not fused) is not deferred: its product runs in
    the backward. Each queued pass holds its two operands until it runs."""

    def __init__(self):
        self.passes = []

    def __len__(self):
        return len(self.passes)

    def append(self, accumulate, add) -> None:
        self.passes.append((accumulate, add))

    def run(self) -> int:
        """Run the queued passes (each adds into its weight's accumulator); returns how many ran. Outside
        autograd's backward, so without grad mode as inside it (the accumulators are views made
        without it, which grad mode forbids modifying in place)."""
        passes, self.passes = self.passes, []
        with torch.no_grad():
            for accumulate, add in passes:
                accumulate(add)
        return len(passes)


class WeightGradSink:
    """Where the W passes of a set of parameters (an engine's) go: each parameter's ``accumulate_grad`` is
    :meth:`accumulator` of it; inside :meth:`deferring` the passes handed to them are queued instead."""

    def __init__(self):
        self.queue: DeferredWeightGrads | None = None

    def accumulator(self, receive) -> "Accumulator":
        return Accumulator(self, receive)

    @contextlib.contextmanager
    def deferring(self, queue: DeferredWeightGrads):
        """W passes handed over inside go to ``queue`` (yielded), to be run by its owner."""
        previous, self.queue = self.queue, queue
        try:
            yield queue
        finally:
            self.queue = previous


class Accumulator:
    """A parameter's ``accumulate_grad``: ``accumulate_grad(add)`` gives ``add(main, overwrite)`` to ``receive``
    (the engine's accumulation), which adds one backward's gradient into the fp32 ``main``, or with
    ``overwrite`` writes it there: ``main`` holds nothing of this step yet (the engine does not zero it
    between steps: the step's first gradient is written, the later ones added)."""

    __slots__ = ("sink", "receive")

    def __init__(self, sink: WeightGradSink, receive):
        self.sink, self.receive = sink, receive

    def __call__(self, add) -> None:
        self.receive(add)


def deferral_of(accumulate) -> DeferredWeightGrads | None:
    """The queue a W pass handed to ``accumulate`` goes to now, or None (it runs at once)."""
    return accumulate.sink.queue if isinstance(accumulate, Accumulator) else None


def hand_over(accumulate, add) -> None:
    """Give ``add(main, overwrite)`` to the engine's accumulator now, or queue it while its sink defers W passes
    (whether it overwrites is decided when it runs)."""
    queue = deferral_of(accumulate)
    if queue is None:
        accumulate(add)
    else:
        queue.append(accumulate, add)


# ----------------------------------------------------------------------------- under torch.compile
@torch.library.custom_op("megand::weight_grad_pass", mutates_args=())
def weight_grad_op(weight: torch.Tensor, grad: torch.Tensor, x: torch.Tensor) -> None:
    """Run time of a compiled backward's W pass: ``weight.accumulate_grad`` gets ``main += grad^T x`` (the
    product of the weight's own policy, ``weight.gemm_policy``), exactly as in eager mode. Only called where
    the layer decided to fuse."""
    gemm, accumulate = weight.gemm_policy, weight.accumulate_grad
    if deferral_of(accumulate) is not None:  # queued past this call: the compiled graph may reuse its buffers
        grad, x = grad.clone(), x.clone()
    hand_over(accumulate, lambda main, overwrite: gemm.add_weight_grad(main, grad, x, overwrite))


@weight_grad_op.register_fake
def _(weight, grad, x):
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
