"""The reads of device values on the host that a step makes inside the model (the routed experts' split
sizes), and the one place that knows a tensor may hold none: a rehearsal runs the step on fake tensors
(shapes and dtypes, no values). There a read answers with its caller's stand-in: for split sizes an even
split, whose activation sizes are those of balanced routing."""

from __future__ import annotations

import torch


def holds_values(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor with values (a fake tensor, or any other subclass, is not)."""
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def host_list(t: torch.Tensor, stand_in) -> list:
    """``t.tolist()`` (a read of device values: on a GPU it waits for them), or ``stand_in()`` where ``t``
    holds no values."""
    return t.tolist() if holds_values(t) else stand_in()


def even_split(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` sizes as even as can be (the first ones one larger)."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def even_offsets(total: int, parts: int) -> list[int]:
    """The cumulative sizes of ``parts`` even parts of ``total`` (the split points of ``tensor_split``)."""
    return [total * (i + 1) // parts for i in range(parts)]
