"""FP8 training on the GEMM seam, under one of the registered recipes (:mod:`.fp8_recipes`, each a record:
tensorwise, rowwise and MXFP8-style block scaling); nothing here compares a recipe's name.

Every product of a layer quantises its two operands now, from the current tensors (dynamic scaling: the
amax of the tensor itself, no history), multiplies them with fp32 accumulation and returns the
high-precision result; master weights, gradients and optimizer state are untouched. Forward operands (x,
W) are e4m3; the output gradient is e5m2 (e4m3 under MX, whose block scales leave it the range).

A scale runs along the product's contraction axis ``k`` of each operand (``a [m, k]``, ``b [k, n]``):

- ``tensorwise``: one fp32 scale per operand, ``amax / fmax``;
- ``rowwise``: one fp32 scale per row of ``a`` and per column of ``b`` (per output element's row/column);
- ``mxfp8``: one power-of-two scale per 32 consecutive elements along ``k`` (an e8m0 exponent,
  ``floor(log2(amax)) - emax`` of the element format, OCP MX), elements saturating at ``fmax``.

Dequantised, an element is ``q * scale``. Quantising rounds to nearest even and saturates at the format's
largest finite value (float8 has no infinity to overflow into).

Layout independence: where tensor parallelism splits an operand, a scale computed on the shard would
differ from the one-process run's, so the shards agree on it (all-reduce max of the amax over the tp
group): a tensorwise scale of any split operand, a rowwise scale when the contraction axis is split. MX
blocks never straddle ranks when each rank's share of the split axis is a multiple of 32.

Products: torch's FP8 kernels where the device has them (:class:`Fp8Kernels`, from the CUDA compute
capability, decided once at start-up) and their shapes allow: ``torch._scaled_mm`` for tensorwise (SM 8.9+)
and rowwise (SM 9.0+, bf16 result), and for MX with e8m0 block scales in cuBLAS's blocked layout (SM 10.0+,
Blackwell; :func:`mx_blocked_scales`); the routed experts' ``torch._scaled_grouped_mm`` (SM 9.0 and 10.x,
:mod:`.fp8_grouped`). Otherwise (CPU, older GPUs, other shapes) an exact emulation: the same quantised
operands dequantised and multiplied in fp32 (the unit tests check the kernel calls against it on CPU,
where torch._scaled_mm runs tensorwise and rowwise as a slow reference kernel).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from megand.core.tensor_parallel import mappings
from megand.core.tensor_parallel.fp8_recipes import RECIPES, Fp8Recipe, fp8_recipe
from megand.core.tensor_parallel.fp8_recipes.mxfp8 import MX_BLOCK, mx_blocked_scales, mx_scale  # noqa: F401
from megand.core.tensor_parallel.fp8_recipes.scaling import _TINY, E4M3, E5M2, _agreed_max, fmax  # noqa: F401
from megand.core.tensor_parallel.gemm import GemmPolicy, weight_grad_target
from megand.core.tensor_parallel.wgrad import add_product


@dataclasses.dataclass
class Quantized:
    """A 2-D tensor in FP8: ``data`` (float8, the source's shape) and fp32 ``scale``, running along ``dim``
    (the contraction axis): ``[]`` one scale; per row the source's shape with ``dim`` of size 1; per block the
    source's shape with ``dim`` cut into blocks (the last one possibly shorter). ``recipe``: its name."""

    data: torch.Tensor
    scale: torch.Tensor
    dim: int
    recipe: str

    @property
    def record(self) -> Fp8Recipe:
        return RECIPES[self.recipe]

    def t(self) -> "Quantized":
        scale = self.scale if self.scale.dim() == 0 else self.scale.t()
        return Quantized(self.data.t(), scale, 1 - self.dim, self.recipe)

    def dequantize(self) -> torch.Tensor:
        """The fp32 values the FP8 bytes stand for."""
        data = self.data.float()
        block = self.record.block
        if block == 1:
            return data * self.scale
        scale = self.scale.repeat_interleave(block, dim=self.dim)
        return data * scale.narrow(self.dim, 0, data.shape[self.dim])

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes


def quantize(t: torch.Tensor, recipe: str, dtype: torch.dtype, dim: int, group=None) -> Quantized:
    """``t`` (2-D) in ``dtype`` with scales along ``dim`` under ``recipe`` (its record's quantiser);
    ``group``: the ranks whose shards of ``t`` must agree on the scales (a recipe whose scales are computed
    from one block alone ignores it)."""
    data, scale = fp8_recipe(recipe).quantize(t, dtype, dim, group)
    return Quantized(data, scale, dim, recipe)


@dataclasses.dataclass(frozen=True)
class Fp8Kernels:
    """Which of torch's FP8 kernels the device runs (the rest is emulated), from its CUDA compute
    capability: ``Fp8Kernels()`` (none) on CPU."""

    tensorwise: bool = False  # torch._scaled_mm with one fp32 scale per operand: SM 8.9+ (Ada, Hopper, Blackwell)
    rowwise: bool = False  # torch._scaled_mm with per-row fp32 scales: SM 9.0+
    grouped: bool = False  # torch._scaled_grouped_mm, per-row scales: SM 9.0 and 10.x (torch's own check)
    mx: bool = False  # torch._scaled_mm with e8m0 scales per 32 elements: SM 10.0+ (Blackwell)

    @classmethod
    def for_capability(cls, capability: tuple[int, int] | None) -> "Fp8Kernels":
        """The kernels of a CUDA device of ``capability`` (major, minor); None: not a CUDA device."""
        if capability is None:
            return cls()
        major, minor = capability
        return cls(tensorwise=capability >= (8, 9), rowwise=major >= 9,
                   grouped=capability == (9, 0) or major == 10, mx=major >= 10)


NO_KERNELS = Fp8Kernels()


def scaled_mm_takes(a: Quantized, b: Quantized, out_dtype: torch.dtype, kernels: Fp8Kernels = NO_KERNELS) -> bool:
    """Whether ``torch._scaled_mm`` runs the product: a CUDA device with the recipe's kernel
    (``kernels``), for the shapes and scalings the kernels accept (on CPU it runs tensorwise and rowwise
    too, but as a slow reference kernel: the emulation is exact and much faster)."""
    if not a.data.is_cuda or a.data.shape[1] % 16 or b.data.shape[1] % 16:
        return False
    rec = a.record
    return (getattr(kernels, rec.kernel) and a.data.shape[1] % rec.block == 0
            and (out_dtype == torch.bfloat16 or not rec.kernel_bf16_only)
            and (a.data.dtype == b.data.dtype == E4M3 or not rec.kernel_e4m3_only))


def scaled_mm_kernel(a: Quantized, b: Quantized, out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """``torch._scaled_mm`` of the operands: ``b`` column-major; rowwise scales ``[m, 1]`` and ``[1, n]``
    with unit strides (as the kernels check them); MX scales e8m0 in cuBLAS's blocked layout (each recipe's
    ``kernel_scales``).
    ``fast_accum``: Hopper's faster fp32 accumulation (partial sums kept at a lower precision between
    promotions), for the forward products of a recipe that allows it (torchao's recipe; never gradients)."""
    column_major = b.data.t().contiguous().t()
    rec = a.record
    scale_a, scale_b = rec.kernel_scales(a.scale, b.scale)
    return torch._scaled_mm(a.data.contiguous(), column_major, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                            use_fast_accum=fast_accum and rec.fast_accum)


def scaled_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype, kernels: Fp8Kernels = NO_KERNELS,
              fast_accum: bool = False, widen: bool = True) -> torch.Tensor:
    """``a @ b`` (``a [m, k]`` scaled along dim 1, ``b [k, n]`` along dim 0), accumulated in fp32: the
    kernel where the device has it and it takes the operands, else the emulation (dequantised operands,
    an fp32 product). An fp32 result the kernel does not return (rowwise: bf16 only) comes from its bf16
    result (it accumulates in fp32 inside the kernel either way), widened, or with ``widen=False`` as is
    (for a caller that adds it into fp32, which widens it in the same pass)."""
    if scaled_mm_takes(a, b, out_dtype, kernels):
        return scaled_mm_kernel(a, b, out_dtype, fast_accum)
    if out_dtype == torch.float32 and scaled_mm_takes(a, b, torch.bfloat16, kernels):
        out = scaled_mm_kernel(a, b, torch.bfloat16, fast_accum)
        return out.float() if widen else out
    return (a.dequantize() @ b.dequantize()).to(out_dtype)


class Fp8Policy(GemmPolicy):
    """A layer's products in FP8 under one of the registered recipes (see the module docstring)."""

    def __init__(self, group=None, split=None, recipe: str = "tensorwise", kernels: Fp8Kernels = NO_KERNELS):
        self.recipe = fp8_recipe(recipe)
        super().__init__(group, split)
        self.name, self.kernels = recipe, kernels
        self.grad_dtype = self.recipe.grad_dtype
        # the logical dims tp splits: a column layer's output features n, a row layer's input features k
        self.sharded = {"column": {"n"}, "row": {"k"}}.get(split, set()) if self._split_over_tp() else set()
        # the weight's operands as gathered in FP8 by ZeRO-3 (keyed by the view a GEMM reads, see
        # megand.core.distributed.fp8_gather): used in place of quantising the weight while it is gathered
        self.gathered = {}
        # the weight's operands quantised this step (keyed as ``gathered``, and by axis but under
        # a one-scale recipe), while :func:`weights_cached` holds the weights fixed; None: quantised at each use
        self.cache = None
        self._grad = None  # one scale: (the output gradient, its FP8) of the input gradient, for the weight's

    def _split_over_tp(self) -> bool:
        return self.group is not None and dist.get_world_size(self.group) > 1

    def __repr__(self):
        return f"Fp8Policy({self.name!r}, split={self.split!r})"

    def bind(self, group, split):
        return Fp8Policy(group, split, self.name, self.kernels)

    def _q(self, t, dtype, dim, dims: str, contraction: str) -> Quantized:
        """Quantise operand ``t`` whose logical dims are ``dims`` (e.g. "mk"), along ``contraction``,
        agreeing the scale over tp where the split makes the shard's scale differ from the whole's."""
        agree = self.recipe.agrees(self.sharded, dims, contraction)
        return quantize(t, self.name, dtype, dim, self.group if agree else None)

    def _weight_q(self, weight, dim, contraction, part=0, parts=1) -> Quantized:
        """The weight's rows of ``part`` (of ``parts`` interleaved) in FP8 along ``dim``: as gathered (found
        by the view's place in the storage: a gathered weight has no high-precision values to view), or
        quantised now."""
        compiling = torch.compiler.is_compiling()
        if (self.gathered or self.cache is not None) and not compiling:
            n, k = weight.shape
            key = (weight.storage_offset() + part * weight.stride(0), (parts * weight.stride(0), weight.stride(1)),
                   (n // parts, k), dim)
            q = self.gathered.get(key)
            if q is not None:
                return q
        if self.cache is not None and not compiling:  # one scale: the same bytes serve either axis
            cached = (*key[:3], None if self.recipe.one_scale else dim)  # a policy serves one weight
            q = self.cache.get(cached)
            if q is not None:
                return q if q.dim == dim else Quantized(q.data, q.scale, dim, q.recipe)
        if parts > 1:
            weight = weight.view(-1, parts, weight.shape[-1])[:, part]
        q = self._q(weight, E4M3, dim, "nk", contraction)
        if self.cache is not None and not compiling:
            self.cache[cached] = q
        return q

    # -- communication ----------------------------------------------------------------------------
    def gather_input(self, x, group):
        """The sequence-parallel all-gather in FP8: the shard is quantised (a scale of the whole operand agreed
        over the tp group first: the shards are split along tokens), then its bytes and scales gathered."""
        flat = x.reshape(-1, x.shape[-1])
        q = quantize(flat, self.name, E4M3, 1, group if self.recipe.agrees({"m"}, "mk", "k") else None)
        data = mappings._gather_first(q.data.view(torch.uint8), group).view(E4M3)
        scale = q.scale if q.scale.dim() == 0 else mappings._gather_first(q.scale, group)
        return Quantized(data, scale, 1, self.name)

    def regather_input(self, x, group):
        """One scale (tensorwise): the weight gradient's x is the forward's FP8 operand (one scale whatever
        the axis), so backward gathers FP8 bytes again; the other recipes scale x along the tokens for it,
        which are split over the ranks: high precision is gathered. Compiled: high precision (the
        compiled weight-gradient hand-over takes a tensor)."""
        if not self.recipe.one_scale or torch.compiler.is_compiling():
            return super().regather_input(x, group)
        return self.gather_input(x, group)

    def input_operand(self, x):
        return self._q(x, E4M3, 1, "mk", "k")

    # -- the three products -----------------------------------------------------------------------
    def forward(self, x, weight, bias=None):
        a = x if isinstance(x, Quantized) else self.input_operand(x)
        b = self._weight_q(weight, 1, "k").t()
        out = scaled_mm(a, b, weight.dtype, self.kernels, fast_accum=True)
        return out if bias is None else out + bias

    def forward_parts(self, x, weight, bias, parts):
        a = x if isinstance(x, Quantized) else self.input_operand(x)
        biases = bias.view(-1, parts) if bias is not None else None
        outs = []
        for part in range(parts):
            out = scaled_mm(a, self._weight_q(weight, 1, "k", part, parts).t(), weight.dtype, self.kernels,
                            fast_accum=True)
            outs.append(out if biases is None else out + biases[:, part])
        return outs

    def input_grad(self, grad, weight):
        a = self._q(grad, self.grad_dtype, 1, "mn", "n")
        if self.recipe.one_scale and not torch.compiler.is_compiling():  # the weight gradient's too
            self._grad = (grad, grad._version, a)
        b = self._weight_q(weight, 0, "n")
        return scaled_mm(a, b, grad.dtype, self.kernels)

    def _weight_product(self, grad, x, out_dtype, widen=True):
        stashed, self._grad = self._grad, None
        if stashed is not None and stashed[0] is grad and stashed[1] == grad._version:  # one scale: the same bytes
            a = Quantized(stashed[2].data, stashed[2].scale, 0, self.name).t()
        else:
            a = self._q(grad, self.grad_dtype, 0, "mn", "m").t()
        if isinstance(x, Quantized):  # gathered in FP8 (one scale: the same bytes along either axis)
            b = Quantized(x.data, x.scale, 0, x.recipe)
        else:
            b = self._q(x, E4M3, 0, "mk", "m")
        return scaled_mm(a, b, out_dtype, self.kernels, widen=widen)

    def weight_grad(self, grad, x):
        return self._weight_product(grad, x, grad.dtype)

    def add_weight_grad(self, main, grad, x, overwrite=False):
        add_product(main, self._weight_product(grad, x, main.dtype, widen=False), overwrite)

    # -- the routed experts ------------------------------------------------------------------------
    def grouped(self, x, weight, counts, offsets, bias=None):
        from megand.core.tensor_parallel.fp8_grouped import GroupedFp8Linear  # it builds on this module

        target = weight_grad_target(weight)
        return GroupedFp8Linear.apply(x, weight, bias, offsets, self, None if target is True else target)


@contextlib.contextmanager
def weights_cached(modules):
    """Within the block, each FP8 layer of ``modules`` whose recipe keeps a weight cache (its record's
    ``weight_cache_bytes``: tensorwise) quantises each of its weights once and reuses the FP8 bytes (one
    byte per weight, serving either axis) for every micro-batch, recomputation and input gradient: the
    weights must not change inside it (the training step wraps its forward and backward; the optimizer steps
    outside). Leaving the block drops them: the next step quantises the updated weights. (Rowwise scales
    differ per axis: two copies per weight; not cached.)"""
    policies = [m.gemm for module in modules for m in module.modules()
                if isinstance(getattr(m, "gemm", None), Fp8Policy) and m.gemm.recipe.weight_cache_bytes]
    for policy in policies:
        policy.cache = {}
    try:
        yield
    finally:
        for policy in policies:
            policy.cache = None


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    """FP8 GEMMs in the transformer layers: the scaling ``recipe`` (a registered recipe's name), all but
    the first and last ``bf16_layers`` layers."""

    recipe: str
    bf16_layers: int = 1

    def layer_count(self, num_layers: int) -> int:
        """How many of ``num_layers`` transformer layers run in FP8."""
        return sum(in_fp8(i, num_layers, self.bf16_layers) for i in range(num_layers))


def in_fp8(layer_id: int, num_layers: int, bf16_layers: int) -> bool:
    """Whether transformer layer ``layer_id`` runs in FP8: all but the first and last ``bf16_layers``."""
    return bf16_layers <= layer_id < num_layers - bf16_layers


def use_fp8(layers, recipe: str, num_layers: int, bf16_layers: int = 1, kernels: Fp8Kernels = NO_KERNELS) -> list[int]:
    """Run the linear and expert GEMMs of the transformer layers ``layers`` (global layer id -> module,
    as keyed by str or int) under ``recipe``, except the first and last ``bf16_layers`` of the
    ``num_layers``; the router and anything outside these layers (embedding, output layer) stay as they
    are; ``kernels``: the device's FP8 kernels (:meth:`Fp8Kernels.for_capability`). Returns the layer ids
    now in FP8."""
    template = Fp8Policy(recipe=recipe, kernels=kernels)
    chosen = []
    for key, layer in layers.items():
        layer_id = int(key)
        if not in_fp8(layer_id, num_layers, bf16_layers):
            continue
        for module in layer.modules():
            if hasattr(module, "set_gemm"):
                module.set_gemm(template)
        chosen.append(layer_id)
    return chosen
