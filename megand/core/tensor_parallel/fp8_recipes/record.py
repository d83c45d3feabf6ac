"""An FP8 recipe as a record: everything the layers, the data-parallel engine, the configuration, the memory
estimator, the planner and the CUDA rehearsal ask of a scaling recipe (``train.fp8``). Adding a recipe is one
file defining its record plus one entry in ``fp8_recipes/__init__.py``; none of those readers compares a
recipe's name.

A scale runs along a product's contraction axis ``k`` (``a [m, k]``, ``b [k, n]``); its ``granularity`` is
what one scale covers along the other axis:

- ``"tensor"``: one scale per operand. It does not depend on the axis: the same FP8 bytes serve a weight's
  forward (scaled along ``k``) and its input gradient (along ``n``), and ``x``'s forward and weight gradient,
  so the layers reuse them (a weight cache for the step, the output gradient's bytes, an FP8 re-gather of
  the sequence-parallel input) and ZeRO-3 gathers FP8 for backward too;
- ``"row"``: one scale per row of ``a`` / column of ``b``;
- ``"block"``: one scale per ``block`` consecutive elements along ``k``, computed from the block alone
  (no agreement between ranks: blocks never straddle a shard when shards are whole blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

GRANULARITIES = ("tensor", "row", "block")


def _as_is(scale_a, scale_b):
    return scale_a, scale_b


@dataclass(frozen=True)
class Fp8Recipe:
    name: str  # train.fp8
    granularity: str  # tensor | row | block (see the module docstring)
    # (t [2-D], dtype, dim, group) -> (data, scale): t in dtype with scales along dim, agreed over group (the
    # ranks whose shards must scale alike; None: no agreement)
    quantize: Callable
    grad_dtype: torch.dtype  # the output gradient's element format (forward operands are e4m3)
    kernel: str  # the Fp8Kernels field naming the device's torch._scaled_mm kernel for it
    kernel_what: str  # that kernel as the CUDA rehearsal names it in a refusal
    block: int = 1  # elements per scale along k (block granularity); engine buckets and slices align to it
    kernel_bf16_only: bool = False  # the kernel returns bf16 only (an fp32 result is its bf16 one, widened)
    kernel_e4m3_only: bool = False  # the kernel takes e4m3 operands only
    kernel_scales: Callable = _as_is  # (scale_a, scale_b) -> the kernel's scale arguments
    fast_accum: bool = True  # forward products may take Hopper's faster accumulation (never gradients)
    grouped_experts: bool = True  # routed experts in the grouped kernels (False: each through the dense path)
    # bytes per weight element that the step's weight cache (tensor.fp8.weights_cached) keeps, for each copy
    # a layer reads; 0: no cache (each product quantises the weight anew)
    weight_cache_bytes: float = 0.0
    # a GPU without the kernel refuses the recipe (emulating it there runs slower than bf16): what it needs,
    # and why; None: emulated where the kernel is missing
    needs: Optional[str] = None
    needs_why: str = ""

    def __post_init__(self):
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"fp8 recipe {self.name}: granularity {self.granularity!r} is not one of "
                             f"{', '.join(GRANULARITIES)}")

    @property
    def one_scale(self) -> bool:
        """One scale per operand, whatever the axis: the FP8 bytes of one axis serve the other."""
        return self.granularity == "tensor"

    @property
    def per_row(self) -> bool:
        return self.granularity == "row"

    @property
    def blocked(self) -> bool:
        return self.granularity == "block"

    def agrees(self, sharded: set, dims: str, contraction: Optional[str]) -> bool:
        """Whether the shards of an operand with logical ``dims`` (e.g. "mk"), split over tp along the dims in
        ``sharded``, must agree on its scales when scaled along ``contraction``: a scale of the whole operand
        whenever any of its dims is split; a row's when the contraction axis is; a block's never."""
        if self.one_scale:
            return bool(sharded & set(dims))
        return self.per_row and contraction in sharded

    def takes_kernel_scale(self, scale: torch.Tensor) -> bool:
        """Whether a torch._scaled_mm call with ``scale_a`` = ``scale`` runs this recipe's kernel."""
        if self.blocked:
            return scale.dtype == torch.float8_e8m0fnu
        return scale.dtype == torch.float32 and (scale.numel() > 1) == self.per_row
