"""The ``model`` group's structured config, generated from core's TransformerConfig, the one model schema.

Every model field of :class:`~megand.core.transformer.TransformerConfig` (all but its runtime fields, which
come from ``parallel.*`` and ``train.*``) is a ``model`` key, with its default and in its order. OmegaConf
types a key by the field's annotation where it can (a primitive, or one primitive or None); a union it
cannot express is ``Any`` here, and TransformerConfig checks the value. ``__wrapped__`` points at the
source class, so its trailing field comments are the configuration reference's (``inspect.getsource``).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Optional

from megand.core.transformer.config import RUNTIME_FIELDS, TransformerConfig

PRIMITIVES = (bool, int, float, str)


def structured_type(annotation):
    """The type OmegaConf validates a key against, from a field's ``annotation``."""
    if annotation in PRIMITIVES:
        return annotation
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    kinds = [a for a in args if a is not type(None)]
    if len(kinds) == 1 and len(args) == 2 and kinds[0] in PRIMITIVES:
        return Optional[kinds[0]]
    return Any


def structured_schema(source, name: str, exclude=frozenset()):
    """A dataclass named ``name`` with the fields of the dataclass ``source`` but ``exclude``, their defaults,
    and the types :func:`structured_type` gives their annotations."""
    hints = typing.get_type_hints(source)
    schema = dataclasses.make_dataclass(name, [
        (f.name, structured_type(hints[f.name]), dataclasses.field(default=f.default))
        for f in dataclasses.fields(source) if f.name not in exclude])
    schema.__module__, schema.__wrapped__ = __name__, source
    return schema


ModelConfig = structured_schema(TransformerConfig, "ModelConfig", exclude=RUNTIME_FIELDS)
