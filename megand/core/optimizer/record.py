"""An optimizer as a record: the state it keeps per parameter element, the parameter roles it takes, and its
update over the engine's shard views. The engine (optimizer.py), the checkpoint's state names, the memory
estimator and the planner read these records; adding an optimizer is one file defining its record plus one
line in registry.py.

An update is built once per optimizer from ``(named_params, pieces, cfg, ddp, topo)``: the parameters it takes
(in the stage's parameter order, the same on every rank, also those of which this rank holds no piece) and
this rank's pieces of them (``optimizer.Piece``: flat fp32 views ``main``, ``grad`` and ``state[name]`` of one
parameter's range on this rank, ``decay`` from its role). It has ``step(lr, grad_norm)``, which clips its
gradients to ``cfg.clip_grad`` (the global ``grad_norm`` is given) and updates ``main`` and its state in place,
and ``set_step(steps)``, called after a checkpoint load with the steps taken.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class OptimizerRecord:
    name: str  # optim.name
    state: tuple[str, ...]  # fp32 tensors per parameter element; checkpoint keys ``optim.<param>.<state name>``
    roles: frozenset  # the ParamMeta roles it takes (megand.core.sharding.ROLES)
    update: Callable  # (named_params, pieces, cfg, ddp, topo) -> an update (see the module docstring)
    # bytes its elementwise update reads and writes per element (the planner's memory-bound optimizer time)
    update_bytes: float
    fallback: Optional[str] = None  # the optimizer of the roles it does not take (None: it takes every role)
    # FLOPs per logical m x n matrix per step for an optimizer that transforms whole matrices (Muon's
    # Newton-Schulz), read by the estimator and the planner; None: elementwise only
    matrix_flops: Optional[Callable[[int, int], float]] = None
    matrix_step: str = ""  # what that work is called in the estimator's report ("Muon Newton-Schulz")
    # (optim config) -> None, raising ValueError naming the key and value of this optimizer's own values
    # (betas, eps, momentum...); the values every optimizer reads are checks.check_common's
    check: Optional[Callable] = None
