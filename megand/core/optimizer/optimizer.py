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
(fused on CUDA, foreach elsewhere; apex's FusedAdam when installed on CUDA) on the piece views.

One step: finish the gradient sync (idempotent) -> unscale (fp16) -> global norm and inf/nan check in
one all-reduce -> skip (loss scaler backs off) or clip, AdamW, write back, all-gather the updated slices.

Checkpoint interface: :meth:`state_dict_per_param` / :meth:`load_state_dict_per_param` (per parameter
name, tensors of the local tp-shard shape) and :meth:`scalar_state` / :meth:`load_scalar_state`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.optim.adamw import adamw as functional_adamw

from megand.core.distributed import DataParallel, DataParallelConfig
from megand.core.optimizer.config import OptimizerConfig
from megand.core.optimizer.grad_norm import clip_grads, norm_and_nonfinite
from megand.core.optimizer.loss_scaler import ConstantLossScaler, DynamicLossScaler
from megand.core.optimizer.lr_schedule import LRSchedule
from megand.core.tensor_parallel.mappings import all_gather_flat

try:  # optional: apex's multi-tensor Adam (CUDA only); torch's fused AdamW is used otherwise
    from apex.optimizers import FusedAdam as ApexFusedAdam
except Exception:  # noqa: BLE001 - any import problem means "not available"
    ApexFusedAdam = None


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
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor  # 0-d, as torch's AdamW wants one per tensor
    decay: bool
    counted: bool  # in the global grad norm (each element of the full model once)


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
        self.schedule = LRSchedule(config.lr, config.min_lr, config.warmup_iters, config.decay_iters, config.schedule)
        fp16 = any(buf.dtype == torch.float16 for buf in ddp.buffers)
        self.scaler = (DynamicLossScaler(config.initial_loss_scale, config.min_loss_scale,
                                         config.loss_scale_window, config.hysteresis)
                       if fp16 else ConstantLossScaler())
        self.steps = 0
        self._build_state()
        device = topo.device
        self.use_apex = ApexFusedAdam is not None and device.type == "cuda"
        self.fused = device.type == "cuda" and not self.use_apex
        if self.use_apex:
            self._apex = self._make_apex()

    # -- state layout --------------------------------------------------------------------------------
    def _build_state(self):
        name_of = {p: n for n, p in self.named_params}
        step_device = self.topo.device if self.topo.device.type == "cuda" else torch.device("cpu")
        self.flat = []  # per buffer: dict(main=, exp_avg=, exp_avg_sq=, segments={bucket index: offset})
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
            state = dict(main=main, exp_avg=torch.zeros(total, dtype=torch.float32, device=buf.grad_data.device),
                         exp_avg_sq=torch.zeros(total, dtype=torch.float32, device=buf.grad_data.device),
                         segments=segments, buffer=buf)
            self.flat.append(state)
            for p, bucket, lo, hi in buf.pieces():
                off = buf.offset[p]
                s = segments[bucket.index] + lo - bucket.shard_start
                self.pieces.append(Piece(
                    name=name_of.get(p, f"<unnamed {tuple(p.shape)}>"), param=p, lo=lo - off, hi=hi - off,
                    main=main[s: s + hi - lo] if separate else bucket.param_piece(lo, hi),
                    grad=bucket.grad_piece(lo, hi), exp_avg=state["exp_avg"][s: s + hi - lo],
                    exp_avg_sq=state["exp_avg_sq"][s: s + hi - lo],
                    step=torch.zeros((), dtype=torch.float32, device=step_device),
                    # hybrid sharding: the replicas of a shard hold the same slice; one of them counts it
                    decay=p.ndim >= 2, counted=p.meta.counted_in_norm and self.ddp.replica_rank == 0))

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
        self.ddp.finish_grad_sync()  # a no-op when the trainer already called it
        grads = [x.grad for x in self.pieces]
        if self.scaler.scale != 1.0 and grads:
            torch._foreach_mul_(grads, 1.0 / self.scaler.scale)
        grad_norm, found_inf = norm_and_nonfinite(
            [x.grad for x in self.pieces if x.counted], grads, self.topo, sharded=self.ddp.distributed)
        lr = self.schedule(self.steps + 1)
        self.scaler.update(found_inf)
        if found_inf:  # every rank saw the same all-reduced flag: all skip together
            return StepResult(grad_norm, True, lr, self.scaler.scale)
        clip_grads(grads, grad_norm, self.clip_grad)
        self._adamw(lr)
        self.steps += 1
        for state in self.flat:  # write the updated slices back into the parameter buffer
            if state["main"] is not None:
                for bucket in state["buffer"].buckets:
                    s = state["segments"][bucket.index]
                    bucket.data_shard.copy_(state["main"][s: s + bucket.shard_end - bucket.shard_start])
        self.ddp.start_param_sync()
        return StepResult(grad_norm, False, lr, self.scaler.scale)

    def _adamw(self, lr):
        c = self.cfg
        for decay in (True, False):
            group = [x for x in self.pieces if x.decay == decay]
            if not group:
                continue
            wd = c.weight_decay if decay else 0.0
            if self.use_apex:
                apex_group = self._apex.param_groups[0 if decay else 1]
                apex_group["lr"] = lr
                continue
            functional_adamw([x.main for x in group], [x.grad for x in group], [x.exp_avg for x in group],
                             [x.exp_avg_sq for x in group], [], [x.step for x in group],
                             foreach=not self.fused, fused=self.fused or None, amsgrad=False, beta1=c.beta1,
                             beta2=c.beta2, lr=lr, weight_decay=wd, eps=c.eps, maximize=False)
        if self.use_apex:
            for x in self.pieces:
                x.main.grad = x.grad
            self._apex.step()
            for x in self.pieces:
                x.main.grad = None

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
    def _full_flat(self, state, key):
        """``state[key]`` spread over the whole buffer layout (gathered over dp x cp when sharded)."""
        buf, flat = state["buffer"], state[key]
        if not self.ddp.distributed or self.ddp.size == 1:
            return flat  # the segments tile the buffer in order
        full = torch.zeros(buf.numel, dtype=flat.dtype, device=flat.device)
        for bucket in buf.buckets:
            s = state["segments"][bucket.index]
            all_gather_flat(full[bucket.start: bucket.end], flat[s: s + bucket.shard_end - bucket.shard_start],
                            group=self.ddp.group)
        return full

    def state_dict_per_param(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{name: {"exp_avg", "exp_avg_sq"[, "main"]}}`` for every parameter of this rank, each of the
        parameter's local (tp-shard) shape, fp32. ``"main"`` is present only when the parameters are not
        fp32 (for fp32 the parameter is its own master copy). Collective over dp x cp with the
        distributed optimizer: every rank must call it."""
        self.ddp.finish_param_sync()
        name_of = {p: n for n, p in self.named_params}
        out = {}
        for state in self.flat:
            buf = state["buffer"]
            for key in ("main", "exp_avg", "exp_avg_sq"):
                if state[key] is None:
                    continue
                full = self._full_flat(state, key)
                for p in buf.params:
                    off = buf.offset[p]
                    out.setdefault(name_of[p], {})[key] = full[off: off + p.numel()].view(p.shape).clone()
        return out

    @torch.no_grad()
    def load_state_dict_per_param(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        """The inverse of :meth:`state_dict_per_param`: each rank keeps its share. Load the model's
        parameters first: without a ``"main"`` entry the master copy is taken from the parameter;
        with one, the parameter is set from it (rounded to its dtype). Under ZeRO-3 the parameters are
        gathered for it and each rank's slices are taken back from them."""
        with self.ddp.gathered_params(write_back=True):
            self._load_state_dict_per_param(states)

    def _load_state_dict_per_param(self, states):
        missing = [n for n, _ in self.named_params if n not in states]
        if missing:
            raise KeyError(f"optimizer state missing for {len(missing)} parameters, e.g. {missing[:3]}")
        for name, p in self.named_params:
            main = states[name].get("main")
            if main is not None:
                p.data.copy_(main.reshape(p.shape))
        for x in self.pieces:
            st = states[x.name]
            main = st.get("main")
            src = main if main is not None else x.param.data
            x.main.copy_(src.reshape(-1)[x.lo: x.hi])
            x.exp_avg.copy_(st["exp_avg"].reshape(-1)[x.lo: x.hi])
            x.exp_avg_sq.copy_(st["exp_avg_sq"].reshape(-1)[x.lo: x.hi])

    def scalar_state(self) -> dict:
        return {"step": self.steps, "loss_scaler": self.scaler.state_dict()}

    def load_scalar_state(self, state: dict) -> None:
        self.steps = int(state["step"])
        for x in self.pieces:
            x.step.fill_(self.steps)
        if self.use_apex:
            for group in self._apex.param_groups:
                group["step"] = self.steps
        self.scaler.load_state_dict(state.get("loss_scaler", {}))
