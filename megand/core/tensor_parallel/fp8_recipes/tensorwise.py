"""``tensorwise``: one fp32 scale per operand, ``amax / fmax``; e5m2 output gradients. Its FP8 bytes serve
either axis, so the weights are quantised once per step and kept (one byte per element and copy)."""

from megand.core.tensor_parallel.fp8_recipes.record import Fp8Recipe
from megand.core.tensor_parallel.fp8_recipes.scaling import E5M2, amax_quantize

RECIPE = Fp8Recipe(
    name="tensorwise", granularity="tensor",
    quantize=lambda t, dtype, dim, group=None: amax_quantize(t, dtype, None, group),
    grad_dtype=E5M2, kernel="tensorwise", kernel_what="FP8 products (SM 8.9+)",
    weight_cache_bytes=1.0)
