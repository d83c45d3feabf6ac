"""The FP8 recipes megand runs (``train.fp8``), one file each defining its :class:`Fp8Recipe` record
(record.py). A new recipe is a new file here and one entry in :data:`RECIPES`, in the order the docs and
the messages list them."""

from __future__ import annotations

import torch

from megand.core.tensor_parallel.fp8_recipes import mxfp8, rowwise, tensorwise
from megand.core.tensor_parallel.fp8_recipes.record import Fp8Recipe

RECIPES: dict[str, Fp8Recipe] = {r.name: r for r in (tensorwise.RECIPE, rowwise.RECIPE, mxfp8.RECIPE)}


def fp8_recipe(name: str) -> Fp8Recipe:
    """The record of recipe ``name``; a ValueError naming the choices for another name."""
    if name not in RECIPES:
        raise ValueError(f"fp8 recipe {name!r}: expected one of {', '.join(RECIPES)}")
    return RECIPES[name]


def kernel_recipe(scale_a: torch.Tensor) -> Fp8Recipe:
    """The recipe whose torch._scaled_mm kernel a call with ``scale_a`` runs."""
    return next(r for r in RECIPES.values() if r.takes_kernel_scale(scale_a))
