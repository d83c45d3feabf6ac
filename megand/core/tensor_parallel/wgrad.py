"""Weight gradients added straight into the data-parallel engine's fp32 accumulator (Megatron's
gradient-accumulation fusion).

Left to autograd, a layer's weight gradient is first made as ``p.grad`` in the parameter's dtype and then
added by the engine's hook into the fp32 ``main_grad``: in a bf16 model every micro-batch's gradient is
rounded to bf16 before it is summed, and a full-size gradient tensor is written and read once more. A
layer that computes its own weight gradient instead hands the product to ``p.accumulate_grad`` (set by the
engine), which adds it into the accumulator at fp32.
"""

import torch

_mm_has_out_dtype = None  # torch.mm(..., out_dtype=) on CUDA: newer torch builds only


def fused_accumulator(weight: torch.Tensor, fuse: bool = True):
    """The engine's ``accumulate_grad`` of ``weight``, or None where autograd's ``p.grad`` path is used: no
    engine, ``fuse`` off (a weight read twice in one backward), or inside torch.compile's trace (the
    compiled backward returns gradients; the hook still accumulates them)."""
    if not fuse or torch.compiler.is_compiling():
        return None
    return getattr(weight, "accumulate_grad", None)


def add_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b`` at ``out``'s precision: a bf16 GEMM with an fp32 result on CUDA, an fp32 GEMM on
    CPU (whose bf16 GEMM rounds its result to bf16)."""
    global _mm_has_out_dtype
    if a.dtype == out.dtype:
        out.addmm_(a, b)
        return
    if out.is_cuda and _mm_has_out_dtype is not False:
        try:
            out.add_(torch.mm(a, b, out_dtype=out.dtype))
            _mm_has_out_dtype = True
            return
        except (TypeError, RuntimeError):
            _mm_has_out_dtype = False
    if out.is_cuda:  # an older torch: the product is rounded to a's dtype, as autograd's p.grad would be
        out.add_(torch.mm(a, b))
    else:
        out.addmm_(a.to(out.dtype), b.to(out.dtype))
