"""``rowwise``: one fp32 scale per row of ``a`` and per column of ``b`` (each output element's row and
column); e5m2 output gradients. Its kernel (SM 9.0+) returns bf16 only and takes the scales as ``[m, 1]``
and ``[1, n]`` with unit strides. Its scales differ per axis: no weight cache."""

from megand.core.tensor_parallel.fp8_recipes.record import Fp8Recipe
from megand.core.tensor_parallel.fp8_recipes.scaling import E5M2, amax_quantize


def _kernel_scales(scale_a, scale_b):
    return scale_a.reshape(-1).view(-1, 1), scale_b.reshape(-1).view(1, -1)


RECIPE = Fp8Recipe(
    name="rowwise", granularity="row",
    quantize=lambda t, dtype, dim, group=None: amax_quantize(t, dtype, dim, group),
    grad_dtype=E5M2, kernel="rowwise", kernel_what="FP8 products with per-row scales (SM 9.0+)",
    kernel_bf16_only=True, kernel_scales=_kernel_scales)
