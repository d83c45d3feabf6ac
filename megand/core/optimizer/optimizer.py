"""The optimizer engine: fp32 main parameters over this rank's share of the gradient buffers, the global
grad norm and clipping, fp16 loss scaling, and the updates of the registered optimizers (registry.py), each
over the pieces of the parameters it takes (by their role).

The share is a list of *pieces*: for every parameter, the part of it that lies in this rank's slice of
its bucket (the whole parameter without the distributed optimizer). Each piece has flat fp32 views:

- ``main``: the master copy of the parameter. For fp32 parameters it is the parameter itself (a view
  into the parameter buffer: nothing is duplicated); for bf16/fp16 a view into ``main_flat``, an fp32
  copy of the rank's slices, written back (rounded) into the parameter buffer after each step;
- ``grad``: the fp32 main gradient (a view into the gradient buffer);
- ``state``: the optimizer's own tensors (its record's ``state`` names: AdamW's ``exp_avg`` and
  ``exp_avg_sq``, Muon's ``momentum``, Lion's ``lion_momentum``), views into flat per-buffer tensors.

So AdamW holds 12 bytes per owned element for bf16 (main + m + v) and 8 for fp32, and the distributed
optimizer owns 1/(dp x cp) of the elements.

One step: finish the gradient sync (idempotent) -> unscale (fp16) -> global norm and inf/nan check in
one all-reduce -> skip (loss scaler backs off) or each optimizer's update (clip, update its pieces), write
back, all-gather the updated slices.

Checkpoint interface: :meth:`sharded_state_dict` (this rank's pieces, as live views: saved as they are
and loaded into in place, so a checkpoint costs no more than the shard) and :meth:`scalar_state` /
:meth:`load_scalar_state`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megand.core.distributed import DataParallel, DataParallelConfig
from megand.core.optimizer.config import OptimizerConfig
from megand.core.optimizer.grad_norm import grad_stats, read_grad_stats
from megand.core.optimizer.loss_scaler import ConstantLossScaler, DynamicLossScaler
from megand.core.optimizer.lr_schedule import LRSchedule
from megand.core.optimizer.registry import chain, optimizer_for


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool
    lr: float
    loss_scale: float = 1.0


@dataclass
class Piece:
    name: str
    param: torch.nn.Parameter
    lo: int  # [lo, hi): offsets inside the flattened parameter
    hi: int
    main: torch.Tensor
    grad: torch.Tensor
    step: torch.Tensor  # 0-d, as torch's AdamW wants one per tensor
    decay: bool  # decoupled weight decay applies (the parameter's role: not norms, biases)
    counted: bool  # in the global grad norm (each element of the full model once)
    separate_main: bool  # main is an fp32 copy (non-fp32 parameters), not the parameter itself
    optimizer: str = "adamw"  # the record that updates it (registry.optimizer_for its role)
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # its record's state tensors, by name


@dataclass(frozen=True)
class StateShard:
    """One parameter's optimizer state on this rank: elements ``[lo, hi)`` of the flattened local
    (tensor-parallel shard, padded) parameter. ``tensors``: kind (``main`` or a state name of its
    optimizer) -> 1-D fp32 view of ``hi - lo`` elements of the optimizer's state."""
    name: str
    param: torch.nn.Parameter  # the local parameter (its ``meta`` places it in the full tensor)
    lo: int
    hi: int
    tensors: dict[str, torch.Tensor]


class _Holder(torch.nn.Module):
    """Lets an optimizer built without an engine (tests, tools) make one over bare parameters."""

    def __init__(self, params):
        super().__init__()
        self.params = torch.nn.ParameterList(params)


class Optimizer:
    def __init__(self, named_params, config: OptimizerConfig, topo, ddp: DataParallel | None = None):
        self.named_params = [(n, p) for n, p in named_params if p.requires_grad]
        self.params = [p for _, p in self.named_params]
        if ddp is None:  # a plain (replicated) engine over the bare parameters
            ddp = DataParallel([_Holder(self.params)], topo, DataParallelConfig())
        self.ddp, self.topo, self.cfg = ddp, topo, config
        self.clip_grad = config.clip_grad
        self.schedule = LRSchedule(config.lr, config.min_lr, config.warmup_iters, config.decay_iters, config.schedule,
                                   config.decay_style, config.decay_fraction, config.decay_start)
        fp16 = any(buf.dtype == torch.float16 for buf in ddp.buffers)
        self.scaler = (DynamicLossScaler(config.initial_loss_scale, config.min_loss_scale,
                                         config.loss_scale_window, config.hysteresis)
                       if fp16 else ConstantLossScaler())
        self.steps = 0
        self.samples = 0  # samples of the applied updates (advanced by the trainer): the schedule's position under a batch-size ramp-up
        self._build_state()

    # -- state layout --------------------------------------------------------------------------------
    def _record_of(self, name, p):
        role = getattr(getattr(p, "meta", None), "role", None)
        if role is None:
            raise ValueError(f"{name}: its ParamMeta declares no role (megand.core.sharding.ROLES): the "
                             f"optimizer chooses by it")
        return optimizer_for(self.cfg.name, role)

    def _build_state(self):
        name_of = {p: n for n, p in self.named_params}
        record_of = {p: self._record_of(n, p) for n, p in self.named_params}
        step_device = self.topo.device if self.topo.device.type == "cuda" else torch.device("cpu")
        self.flat = []  # per buffer: dict(main=, state={(optimizer, state name): flat}, segments={bucket: offset})
        self.pieces: list[Piece] = []
        for buf in self.ddp.buffers:
            segments, total = {}, 0
            for bucket in buf.buckets:
                segments[bucket.index] = total
                total += bucket.shard_end - bucket.shard_start
            separate = buf.dtype != torch.float32
            main = None
            if separate:
                main = torch.cat([b.data_shard.float() for b in buf.buckets]) if buf.buckets else \
                    torch.zeros(0, device=buf.param_data.device)
            placed = list(buf.pieces())
            # each optimizer's state: one flat tensor per state name over the pieces it updates in this buffer
            sizes = {}
            for p, _, lo, hi in placed:
                sizes[record_of[p].name] = sizes.get(record_of[p].name, 0) + hi - lo
            state, filled = {}, {}
            for rec in {record_of[p].name: record_of[p] for p, *_ in placed}.values():
                for kind in rec.state:
                    state[rec.name, kind] = torch.zeros(sizes[rec.name], dtype=torch.float32,
                                                        device=buf.grad_data.device)
                filled[rec.name] = 0
            self.flat.append(dict(main=main, state=state, segments=segments, buffer=buf))
            for p, bucket, lo, hi in placed:
                off = buf.offset[p]
                s = segments[bucket.index] + lo - bucket.shard_start
                rec, at = record_of[p], filled[record_of[p].name]
                filled[rec.name] += hi - lo
                self.pieces.append(Piece(
                    name=name_of.get(p, f"<unnamed {tuple(p.shape)}>"), param=p, lo=lo - off, hi=hi - off,
                    main=main[s: s + hi - lo] if separate else bucket.param_piece(lo, hi),
                    grad=bucket.grad_piece(lo, hi),
                    step=torch.zeros((), dtype=torch.float32, device=step_device),
                    decay=p.meta.decays,
                    # each element of the full model once (replicas of a slice, tp copies, expert-dp copies)
                    counted=self.ddp.counts_in_norm(p),
                    separate_main=separate, optimizer=rec.name,
                    state={kind: state[rec.name, kind][at: at + hi - lo] for kind in rec.state}))
        # one update per optimizer of the chain that takes any parameter of the stage (on every rank alike:
        # an update may run collectives); its parameters in the stage's order
        self.updates = []
        for rec in chain(self.cfg.name):
            named = [(n, p) for n, p in self.named_params if record_of[p] is rec]
            if named:
                self.updates.append(rec.update(named, [x for x in self.pieces if x.optimizer == rec.name],
                                               self.cfg, self.ddp, self.topo))

    @property
    def fused(self) -> bool:
        """Whether an update runs torch's fused kernel (AdamW on CUDA and CPU)."""
        return any(getattr(u, "fused", False) for u in self.updates)

    @property
    def use_apex(self) -> bool:
        """Whether an update runs apex's FusedAdam (AdamW on CUDA, apex installed)."""
        return any(getattr(u, "use_apex", False) for u in self.updates)

    def state_tensors(self):
        """The tensors the optimizer itself holds (fp32 main copies, the optimizers' states), for memory
        accounting."""
        for flat in self.flat:
            if flat["main"] is not None:
                yield flat["main"]
            yield from flat["state"].values()

    def state_bytes(self) -> int:
        """Resident bytes of parameters, gradients and optimizer state on this rank."""
        return self.ddp.resident_bytes() + sum(t.numel() * t.element_size() for t in self.state_tensors())

    # -- the step ------------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to run backward on (multiplied by the fp16 loss scale; unchanged otherwise)."""
        return loss * self.scaler.scale if self.scaler.scale != 1.0 else loss

    def zero_grad(self):
        self.ddp.zero_grad()

    def step(self) -> StepResult:
        grad_norm, found_inf = read_grad_stats(self.prepare_grads())
        lr = self.schedule(self.steps + 1)
        self.scaler.update(found_inf)
        if found_inf:  # every rank saw the same all-reduced flag: all skip together
            return StepResult(grad_norm, True, lr, self.scaler.scale)
        self.update(grad_norm, lr)
        return StepResult(grad_norm, False, lr, self.scaler.scale)

    # The two halves of step(), around its one read of device values (the norm and the inf/nan flag);
    # a rehearsal on fake tensors, which hold no values, runs them with a norm of its choosing.
    def prepare_grads(self) -> torch.Tensor:
        """Finish the gradient sync, unscale (fp16); the global ``[sum of squares, non-finite count]``."""
        self.ddp.finish_grad_sync()  # a no-op when the trainer already called it
        grads = [x.grad for x in self.pieces]
        if self.scaler.scale != 1.0 and grads:
            torch._foreach_mul_(grads, 1.0 / self.scaler.scale)
        return grad_stats([x.grad for x in self.pieces if x.counted], grads, self.topo, sharded=self.ddp.norm_over_world)

    def update(self, grad_norm: float, lr: float) -> None:
        """Each optimizer's update (clipping its gradients), write the updated slices back and start their
        all-gather."""
        for u in self.updates:
            u.step(lr, grad_norm)
        self.steps += 1
        for flat in self.flat:  # write the updated slices back into the parameter buffer
            if flat["main"] is not None:
                for bucket in flat["buffer"].buckets:
                    s = flat["segments"][bucket.index]
                    bucket.data_shard.copy_(flat["main"][s: s + bucket.shard_end - bucket.shard_start])
        self.ddp.start_param_sync()

    # -- checkpoint interface --------------------------------------------------------------------------
    def sharded_state_dict(self) -> list[StateShard]:
        """This rank's share of the optimizer state: one :class:`StateShard` per piece (see the module
        docstring), whose tensors are live views of the optimizer's own state. No copy, no collective:
        the bytes returned are the bytes the optimizer holds (12/(dp x cp) per parameter element for
        bf16 with the distributed optimizer). A checkpoint writes the views as they are and loads into
        them in place; ``"main"`` is present only where the master copy is separate from the parameter
        (non-fp32 parameters); the others are the state names of the piece's optimizer."""
        return [StateShard(x.name, x.param, x.lo, x.hi, {**({"main": x.main} if x.separate_main else {}), **x.state})
                for x in self.pieces]

    def scalar_state(self) -> dict:
        return {"step": self.steps, "samples": self.samples, "loss_scaler": self.scaler.state_dict()}

    def load_scalar_state(self, state: dict) -> None:
        self.steps = int(state["step"])
        self.samples = int(state.get("samples", 0))
        for u in self.updates:
            u.set_step(self.steps)
        self.scaler.load_state_dict(state.get("loss_scaler", {}))
