"""NCCL's answers and rules on torch's fake process group, for a rehearsal on fake CUDA tensors.

The fake backend returns at once from every collective. While :class:`NcclRules` is entered:

- ``dist.get_backend`` answers ``"nccl"`` for the device's groups (those not made with an explicit
  ``backend=``), so the training code takes its NCCL branches (untagged pipeline messages...);
- ``dist.batch_isend_irecv`` returns ONE request for the whole batch, as NCCL coalesces it (waiting for
  a receive waits for the sends of the same batch too);
- a CPU tensor handed to a collective of a device group fails with the call and the source line (NCCL
  takes device tensors only; gloo groups made for host tensors are exempt);
- ``dist.new_group`` calls are counted (each one is a communicator split over the world at scale).
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
import torch.distributed as dist

from megand.tools.device_rules import RehearsalError, source_line

COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather", "reduce_scatter",
               "broadcast", "reduce", "all_to_all_single", "all_to_all", "send", "recv", "scatter", "gather")


class CombinedWork:
    """The one request NCCL returns for a coalesced batch of point-to-point operations."""

    def __init__(self, works):
        self.works = works

    def wait(self, timeout=None):
        for w in self.works:
            w.wait()
        return True

    def is_completed(self):
        return True  # the fake backend returns at once: nothing is in flight (its works answer False until waited)


class NcclRules:
    """See the module docstring. ``groups_created``: ``dist.new_group`` calls while entered."""

    def __init__(self):
        self.groups_created = 0
        self._host_groups = set()  # groups made with an explicit non-NCCL backend (gloo for host tensors)
        self._stack = contextlib.ExitStack()
        self._real = {}

    def _device_group(self, group) -> bool:
        return (group if group is not None else dist.group.WORLD) not in self._host_groups

    def _check(self, name, tensors, group) -> None:
        if not self._device_group(group):
            return
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type != "cuda":
                raise RehearsalError(f"dist.{name}: a {t.device.type} tensor {tuple(t.shape)} {t.dtype} in a collective "
                                     f"of an NCCL group (NCCL takes CUDA tensors only) (at {source_line()})")

    def _wrap(self, name):
        real = self._real[name]

        def collective(*args, **kwargs):
            group = kwargs.get("group")
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
            tensors += [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
            self._check(name, tensors, group)
            return real(*args, **kwargs)

        return collective

    def _new_group(self, *args, **kwargs):
        self.groups_created += 1
        group = self._real["new_group"](*args, **kwargs)
        backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
        if backend is not None and "nccl" not in str(backend).lower():
            self._host_groups.add(group)
        return group

    def _get_backend(self, group=None):
        return "nccl" if self._device_group(group) else self._real["get_backend"](group)

    def _batch_isend_irecv(self, ops):
        for op in ops:
            self._check("batch_isend_irecv", [op.tensor], op.group)
        works = self._real["batch_isend_irecv"](ops)
        return [CombinedWork(works)] if works else works

    def __enter__(self):
        names = [n for n in COLLECTIVES if hasattr(dist, n)] + ["new_group", "get_backend", "batch_isend_irecv"]
        self._real = {n: getattr(dist, n) for n in names}
        replacements = {n: self._wrap(n) for n in COLLECTIVES if hasattr(dist, n)}
        replacements.update(new_group=self._new_group, get_backend=self._get_backend,
                            batch_isend_irecv=self._batch_isend_irecv)
        for name, fn in replacements.items():
            self._stack.enter_context(mock.patch.object(dist, name, fn))
        return self

    def __exit__(self, *exc):
        self._stack.close()
        return False
