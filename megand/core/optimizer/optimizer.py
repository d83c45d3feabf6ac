"""AdamW on fp32 main parameters, over this rank's share of the gradient buffers.

The share is a list of *pieces*: for every parameter, the part of it that lies in this rank's slice of
its bucket (the whole parameter without the distributed optimizer). Each piece has flat fp32 views:

- ``main``: the master copy of the parameter. For fp32 parameters it is the parameter itself (a view
  into the parameter buffer: nothing is duplicated); for bf16/fp16 a view into ``main_flat``, an fp32
  copy of the rank's slices, written back (rounded) into the parameter buffer after each step;
- ``grad``: the fp32 main gradient (a view into the gradient buffer);
- ``exp_avg`` / ``exp_avg_sq``: Adam's moments, views into flat per-buffer tensors.

So the optimizer holds 12 bytes per owned element for bf16 (main + m + v) and 8 for fp32, and the
distributed optimizer owns 1/(dp x cp) of the elements. The update itself is torch's functional AdamW
(fused on CUDA and CPU: one pass over parameter, gradient and moments instead of a foreach
kernel per term, about 3x faster on CPU; foreach elsewhere; apex's FusedAdam when installed on CUDA) on the piece views.

One step: finish the gradient sync (idempotent) -> unscale (fp16) -> global norm and inf/nan check in
one all-reduce -> skip (loss scaler backs off) or clip, AdamW, write back, all-gather the updated slices.

Checkpoint interface: :meth:`sharded_state_dict` (this rank's pieces, as live views: saved as they are
and loaded into in place, so a checkpoint costs no more than the shard) and :meth:`scalar_state` /
:meth:`load_scalar_state`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.optim.adamw import adamw as functional_adamw

from megand.core.distributed import DataParallel, DataParallelConfig
from megand.core.optimizer.config import OptimizerConfig
from megand.core.optimizer.grad_norm import clip_coefficient, clip_grads, grad_stats, read_grad_stats
from megand.core.optimizer.loss_scaler import ConstantLossScaler, DynamicLossScaler
from megand.core.optimizer.lr_schedule import LRSchedule
from megand.core.optimizer.muon import MuonParam, is_muon_param

try:  # optional: apex's multi-tensor Adam (CUDA only); torch's fused AdamW is used otherwise
    from apex.optimizers import FusedAdam as ApexFusedAdam
except Exception:  # noqa: BLE001 - any import problem means "not available"
    ApexFusedAdam = None


# torch's fused AdamW kernel: elementwise, so its result does not depend on how the state is cut into pieces
FUSED_ADAMW_DEVICES = ("cuda", "cpu")


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
    exp_avg: torch.Tensor  # Adam's first moment; Muon's momentum buffer
    exp_avg_sq: torch.Tensor | None  # Adam's second moment (None for a Muon piece)
    step: torch.Tensor  # 0-d, as torch's AdamW wants one per tensor
    decay: bool
    counted: bool  # in the global grad norm (each element of the full model once)
    separate_main: bool  # main is an fp32 copy (non-fp32 parameters), not the parameter itself
    muon: bool = False  # updated by Muon (a hidden matrix under optim.name=muon), else AdamW


@dataclass(frozen=True)
class StateShard:
    """One parameter's optimizer state on this rank: elements ``[lo, hi)`` of the flattened local
    (tensor-parallel shard, padded) parameter. ``tensors``: kind (``main``, ``exp_avg``, ``exp_avg_sq``)
    -> 1-D fp32 view of ``hi - lo`` elements of the optimizer's state."""
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
        device = topo.device
        self.use_apex = ApexFusedAdam is not None and device.type == "cuda" and not self.muon_params
        self.fused = device.type in FUSED_ADAMW_DEVICES and not self.use_apex
        if self.use_apex:
            self._apex = self._make_apex()

    # -- state layout --------------------------------------------------------------------------------
    def _build_state(self):
        name_of = {p: n for n, p in self.named_params}
        step_device = self.topo.device if self.topo.device.type == "cuda" else torch.device("cpu")
        self.flat = []  # per buffer: dict(main=, exp_avg=, exp_avg_sq=, segments={bucket index: offset})
        # the hidden matrices Muon updates (optim.name=muon), in parameter order: a dict used as an ordered set
        muon = {p: None for n, p in self.named_params if self.cfg.name == "muon" and is_muon_param(n, p)}
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
            # Muon keeps one buffer (its momentum, in exp_avg): the second moment covers AdamW's pieces only
            adam_total = sum(hi - lo for p, _, lo, hi in placed if p not in muon)
            state = dict(main=main, exp_avg=torch.zeros(total, dtype=torch.float32, device=buf.grad_data.device),
                         exp_avg_sq=torch.zeros(adam_total, dtype=torch.float32, device=buf.grad_data.device),
                         segments=segments, buffer=buf)
            self.flat.append(state)
            sq = 0
            for p, bucket, lo, hi in placed:
                off = buf.offset[p]
                s = segments[bucket.index] + lo - bucket.shard_start
                name = name_of.get(p, f"<unnamed {tuple(p.shape)}>")
                self.pieces.append(Piece(
                    name=name, param=p, lo=lo - off, hi=hi - off,
                    main=main[s: s + hi - lo] if separate else bucket.param_piece(lo, hi),
                    grad=bucket.grad_piece(lo, hi), exp_avg=state["exp_avg"][s: s + hi - lo],
                    exp_avg_sq=None if p in muon else state["exp_avg_sq"][sq: sq + hi - lo], muon=p in muon,
                    step=torch.zeros((), dtype=torch.float32, device=step_device),
                    # matrices decay; biases do not, also the stacked [E, out] biases of MoE experts
                    decay=p.ndim >= 2 and not name.endswith(".bias"),
                    # each element of the full model once (replicas of a slice, tp copies, expert-dp copies)
                    counted=self.ddp.counts_in_norm(p),
                    separate_main=separate))
                sq += 0 if p in muon else hi - lo
        # Muon's matrices in the stage's parameter order (the same on every rank: the order of the collectives)
        self.muon_params = [MuonParam(p, [x for x in self.pieces if x.param is p], self.ddp.bucket_of[p].buffer.reduce.group,
                                      self.ddp.distributed, self.topo.tp_group if self.topo.tp_size > 1 else None, i)
                            for i, p in enumerate(muon)]

    def state_tensors(self):
        """The tensors the optimizer itself holds (fp32 main copies, Adam moments), for memory accounting."""
        for state in self.flat:
            for key in ("main", "exp_avg", "exp_avg_sq"):
                if state[key] is not None:
                    yield state[key]

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
        """Clip, AdamW, write the updated slices back and start their all-gather."""
        if self.fused:  # the fused kernel clips as it reads each gradient (its grad_scale divides): no extra pass
            clip_grads([x.grad for x in self.pieces if x.muon], grad_norm, self.clip_grad)
            self._adamw(lr, clip_coefficient(grad_norm, self.clip_grad))
        else:
            clip_grads([x.grad for x in self.pieces], grad_norm, self.clip_grad)
            self._adamw(lr)
        if self.muon_params:
            self._muon(lr)
        self.steps += 1
        for state in self.flat:  # write the updated slices back into the parameter buffer
            if state["main"] is not None:
                for bucket in state["buffer"].buckets:
                    s = state["segments"][bucket.index]
                    bucket.data_shard.copy_(state["main"][s: s + bucket.shard_end - bucket.shard_start])
        self.ddp.start_param_sync()

    def _adamw(self, lr, clip: float | None = None):
        """``clip``: the fused kernel's factor on the gradients (the others are clipped before)."""
        c = self.cfg
        for decay in (True, False):
            group = [x for x in self.pieces if x.decay == decay and not x.muon]
            if not group:
                continue
            wd = c.weight_decay if decay else 0.0
            if self.use_apex:
                apex_group = self._apex.param_groups[0 if decay else 1]
                apex_group["lr"] = lr
                continue
            grad_scale = None if clip is None else torch.full((), 1.0 / clip, dtype=torch.float32,
                                                              device=group[0].grad.device)
            functional_adamw([x.main for x in group], [x.grad for x in group], [x.exp_avg for x in group],
                             [x.exp_avg_sq for x in group], [], [x.step for x in group],
                             foreach=not self.fused, fused=self.fused or None, grad_scale=grad_scale, amsgrad=False,
                             beta1=c.beta1, beta2=c.beta2, lr=lr, weight_decay=wd, eps=c.eps, maximize=False)
        if self.use_apex:
            for x in self.pieces:
                x.main.grad = x.grad
            self._apex.step()
            for x in self.pieces:
                x.main.grad = None

    def _muon(self, lr):
        """Momentum (Nesterov), Newton-Schulz of each whole matrix (see muon.py), decoupled weight decay.
        Newton-Schulz runs in fp32 for fp32 parameters, in bf16 otherwise (as published)."""
        c = self.cfg
        mu, decay = c.muon_momentum, 1.0 - lr * c.weight_decay
        ns_dtype = torch.float32 if all(buf.dtype == torch.float32 for buf in self.ddp.buffers) else torch.bfloat16
        for mp in self.muon_params:
            updates = []
            for x in mp.pieces:
                x.exp_avg.mul_(mu).add_(x.grad)
                updates.append(x.grad.add(x.exp_avg, alpha=mu) if c.muon_nesterov else x.exp_avg)
            for x, o in zip(mp.pieces, mp.step(updates, c.muon_ns_steps, ns_dtype)):
                x.main.mul_(decay).add_(o, alpha=-lr)

    def _make_apex(self):
        """apex FusedAdam (adam_w_mode) over the piece views, its state pointed at our flat moments."""
        c = self.cfg
        groups = [{"params": [x.main for x in self.pieces if x.decay == d], "weight_decay": c.weight_decay if d else 0.0}
                  for d in (True, False)]
        opt = ApexFusedAdam(groups, lr=c.lr, betas=(c.beta1, c.beta2), eps=c.eps, adam_w_mode=True)
        for x in self.pieces:
            opt.state[x.main] = {"exp_avg": x.exp_avg, "exp_avg_sq": x.exp_avg_sq}
        return opt

    # -- checkpoint interface --------------------------------------------------------------------------
    def sharded_state_dict(self) -> list[StateShard]:
        """This rank's share of the optimizer state: one :class:`StateShard` per piece (see the module
        docstring), whose tensors are live views of the optimizer's own state. No copy, no collective:
        the bytes returned are the bytes the optimizer holds (12/(dp x cp) per parameter element for
        bf16 with the distributed optimizer). A checkpoint writes the views as they are and loads into
        them in place; ``"main"`` is present only where the master copy is separate from the parameter
        (non-fp32 parameters)."""
        return [StateShard(x.name, x.param, x.lo, x.hi,
                           {**({"main": x.main} if x.separate_main else {}),
                            **({"momentum": x.exp_avg} if x.muon else {"exp_avg": x.exp_avg, "exp_avg_sq": x.exp_avg_sq})})
                for x in self.pieces]

    def scalar_state(self) -> dict:
        return {"step": self.steps, "samples": self.samples, "loss_scaler": self.scaler.state_dict()}

    def load_scalar_state(self, state: dict) -> None:
        self.steps = int(state["step"])
        self.samples = int(state.get("samples", 0))
        for x in self.pieces:
            x.step.fill_(self.steps)
        if self.use_apex:
            for group in self._apex.param_groups:
                group["step"] = self.steps
        self.scaler.load_state_dict(state.get("loss_scaler", {}))
