"""Rehearse one rank of any layout on one CPU: build it, run one training step, and report the peak bytes
of each phase next to the memory estimator's prediction.

    python tools/rehearse.py +experiment=llama70b_64gpu --world-size 64 --rank 0
    python tools/rehearse.py +experiment=llama8b_8gpu --world-size 8 --rank 0 --device cuda
    python tools/rehearse.py +experiment=llama8b_8gpu --world-size 8 --rank 7 --device cuda --json

The overrides are the training config's (Hydra, as for ``pretrain_gpt.py``). This process plays rank
``--rank`` of a world of ``--world-size`` ranks (default tp*pp*cp*(dp or 1), as tools/estimate.py) on
torch's fake process group (collectives return at once, no other process exists), and every tensor is a
fake tensor (shape, dtype and device, no memory), so a 70B layout rehearses in a few GiB of host RAM.
The step is the trainer's own (``Trainer.train_step``: batch to the device, the pipeline schedule, the
gradient reduction, the agreed loss and norm, the optimizer), on mock tokens. A dispatch mode counts the
bytes of the storages alive after every operation; each phase reports the peak of that count
(everything this rank holds, e.g. parameters during forward, included):

- ``build``: the model built on the meta device, the engine's parameter and gradient buffers, the
  tile-wise initialisation and the optimizer's states;
- ``forward_backward``: the batch's copy to the device, the schedule over this rank's micro-batches,
  then the gradient reduction;
- ``optimizer_step``: the agreed loss and gradient norm, clipping, AdamW, write-back and parameter
  all-gather (fake tensors hold no values: the agreed loss reads as 0, finite);
- ``checkpoint_state_dict``: the state dict a checkpoint save hands to torch.distributed.checkpoint
  (model pieces and the optimizer's per-parameter states), built but not written.

The estimator (megand/tools/estimate_memory.py) predicts states for build and the optimizer step, and
states plus activations for forward_backward. With stages of different widths (the per-stage
``parallel.pipeline_layout``) the rank is built at its own stage's width and set against that stage's
estimate at its width. The number of micro-batches per dp rank is cut to the
fewest that reach the schedule's steady state (2 without a pipeline, pp for 1F1B, 2*pp interleaved;
``--microbatches`` overrides): more only repeat it.

``--device cpu`` (default) runs torch's CPU operations. Where they store more than the CUDA kernels the
forward_backward peak is above a GPU run's: ``F.rms_norm`` on bf16 (no fused CPU kernel) keeps two fp32
tensors of its input's size (8 bytes per element instead of 2), e.g. ~8.6 GiB more on the first stage of
llama70b_64gpu.

``--device cuda`` plays the rank as on a GPU node: every tensor a fake CUDA tensor in the run's
precision, CUDA's kernels (their meta versions: flash attention keeps its log-sum-exp, not ``s x s``
scores; fused RMSNorm keeps no fp32 copy), the process group answering as NCCL does, stand-ins for the
CUDA runtime (megand/tools/fake_cuda.py: streams, events, memory statistics, the CUDA generator, pinned
memory). It runs in a child process (the runtime stand-in must be loaded before torch). It fails,
naming the operation and the source line, where CUDA or NCCL would refuse the call
(megand/tools/device_rules.py, megand/tools/fake_nccl.py); counts the step's host synchronisations per
source line and fails above the allowed ones (the step's one read of the agreed loss and norm; the
``synchronize`` of a logged step, when ``train.log_interval=1``; MoE's documented read of the split sizes per MoE layer and micro-batch, which fake tensors skip:
routing is assumed even); reports which attention kernel each call site ran and configures the
estimator's column accordingly (fused attention when every call site ran a fused kernel); and gives a
fit verdict against the device's memory (``--device-memory-gib``, default from ``--device-profile``):
a rank that does not fit exits non-zero with one line naming the phase and the bytes.

Private torch APIs used (no public equivalent in torch 2.13): the fake process group
(``torch.testing._internal.distributed.fake_pg``, via megand.core.parallel_state.init_fake_distributed)
and ``torch._subclasses.fake_tensor.FakeTensorMode``; the byte count uses the public
``torch.utils._python_dispatch.TorchDispatchMode`` (documented, underscore module).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import weakref
from contextlib import ExitStack

import torch
from omegaconf import OmegaConf
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

PHASES = ("build", "forward_backward", "optimizer_step", "checkpoint_state_dict")


class LiveBytes(TorchDispatchMode):
    """Bytes of every tensor storage alive (counted once, however many views), and their peak.

    A storage is counted when an operation first returns a tensor on it and uncounted when it is freed,
    so autograd's saved tensors, gradients and temporaries all count while they live. A storage resized
    in place (ZeRO-3 frees a gathered bucket's storage and allocates it again, outside any operation) is
    recounted when an operation next reads or writes it, and every count is refreshed before a new peak
    is taken, so a resized storage counts at its size at that moment.
    """

    def __init__(self, device_type: str | None = None):
        super().__init__()
        self.device_type = device_type  # count only storages on this kind of device (None: all)
        self.live = self.peak = 0
        self._alive: dict[int, list] = {}  # id(storage) -> [weak reference, bytes counted]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves((out, args, kwargs)):
            if isinstance(t, torch.Tensor) and (self.device_type is None or t.device.type == self.device_type):
                self._count(t.untyped_storage())
        if self.live > self.peak:
            self._refresh()
            self.peak = max(self.peak, self.live)
        return out

    def _count(self, storage) -> None:
        key = id(storage)
        entry = self._alive.get(key)
        if entry is not None and entry[0]() is storage:
            self._recount(entry, storage)
            return
        nbytes = storage.nbytes()
        self._alive[key] = [weakref.ref(storage, lambda _, k=key: self._free(k)), nbytes]
        self.live += nbytes

    def _recount(self, entry, storage) -> None:
        nbytes = storage.nbytes()
        self.live += nbytes - entry[1]
        entry[1] = nbytes

    def _refresh(self) -> None:
        for entry in list(self._alive.values()):
            storage = entry[0]()
            if storage is not None:
                self._recount(entry, storage)

    def _free(self, key: int) -> None:
        entry = self._alive.pop(key, None)
        if entry is not None:
            self.live -= entry[1]

    def reset_peak(self) -> None:
        self._refresh()
        self.peak = self.live



DEVICES_PER_NODE = 8


def parse_args(argv=None) -> argparse.Namespace:
    from megand.tools.rehearsal_devices import DEFAULT, DEVICES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for pretrain_gpt.py (key=value, model=NAME)")
    p.add_argument("--rank", type=int, default=0, help="the global rank to rehearse")
    p.add_argument("--world-size", type=int, default=None, help="ranks of the run (default: tp*pp*cp*(dp or 1))")
    p.add_argument("--microbatches", type=int, default=None,
                   help="micro-batches per dp rank (default: the fewest that reach the schedule's steady state)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="play the rank on the CPU's kernels or as on a CUDA/NCCL node (fake CUDA tensors)")
    p.add_argument("--device-profile", choices=sorted(DEVICES), default=DEFAULT,
                   help=f"the GPU played (--device cuda): its compute capability, kernels and memory "
                        f"(default {DEFAULT})")
    p.add_argument("--device-memory-gib", type=float, default=None,
                   help="the memory a rank may use on the device, GiB (default: the profile's usable memory: its "
                        "reported total less the CUDA context); the fit verdict keeps a margin below it")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_intermixed_args(argv)
    if args.device_memory_gib is not None and args.device_memory_gib <= 0:
        p.error(f"--device-memory-gib must be positive, got {args.device_memory_gib}")
    if args.device_memory_gib is None:
        args.device_memory_gib = DEVICES[args.device_profile].usable_gib
    return args


def prepare_config(args):
    """The composed config with the rehearsal's changes: mock data, the cut global batch, no checkpoints."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from megand.core.parallel_layout import LayoutError, ParallelLayout
    from megand.training.config import ConfigError, compose, validate

    try:
        cfg = compose(args.overrides)
    except (HydraException, OmegaConfBaseException) as e:  # an unknown preset or key, a bad value
        message = str(e).split("Config search path")[0]  # Hydra appends its search path: noise here
        raise SystemExit(f"rehearse: {' '.join(message.split())}")
    p, t = cfg.parallel, cfg.train
    try:
        world = args.world_size or ParallelLayout.world_of(p)
        layout = ParallelLayout.from_keys({**p, "dp": None}, world)  # a parallel.dp that disagrees: validate() below
    except LayoutError as e:
        raise SystemExit(f"rehearse: {e}")
    if not 0 <= args.rank < world:
        raise SystemExit(f"rehearse: --rank {args.rank} is not in a world of {world} ranks")
    configured = layout.microbatches(t.global_batch_size, t.micro_batch_size)
    if layout.dp_microbatches is not None:  # uneven shares: the rank's peak is the largest share's
        configured = max(layout.dp_microbatches)
        p.dp_microbatches = None  # the rehearsal's own batch below, split evenly
    micro = args.microbatches or min(max(configured, 1), layout.steady_microbatches)
    t.global_batch_size = micro * t.micro_batch_size * layout.dp
    cfg.data.kind = "mock"
    cfg.checkpoint.save = cfg.checkpoint.load = None
    t.compile = False  # the rehearsal runs the eager step (torch.compile does not trace fake CUDA here)
    if "rampup_batch_size" in t:
        t.rampup_batch_size = None  # the full batch: the steady state of the run
    try:
        validate(cfg, world)
    except ConfigError as e:
        raise SystemExit(f"rehearse: invalid configuration for world size {world}: {e}")
    return cfg, world, micro


def estimator_phases(cfg, world: int, stage: int, fused_attention: bool = False) -> dict:
    """The estimator's prediction for this rank's pipeline stage, per phase (``fused_attention``: the
    attention kernels keep no ``s x s`` probabilities, as flash/memory-efficient/FlexAttention)."""
    from megand.tools.estimate_memory import Layout, estimate_memory

    model = OmegaConf.to_container(cfg.model, resolve=True)
    layout = dataclasses.replace(Layout.from_config(cfg.parallel, cfg.train, cfg.optim, world_size=world),
                                 fused_attention=fused_attention)
    st = estimate_memory(model, layout, stages=[stage]).stages[0]
    states = st.param_bytes + st.grad_bytes + st.optimizer_bytes
    return {"build": states, "forward_backward": st.total_bytes, "optimizer_step": states,
            "checkpoint_state_dict": states}


# the trainer's progress phases (Trainer._progress) -> the rehearsal's phases
STEP_PHASES = {"data": "forward_backward", "forward-backward (pipeline schedule)": "forward_backward",
               "gradient reduction": "forward_backward", "loss agreement": "optimizer_step",
               "optimizer step": "optimizer_step", "batch checksum": "optimizer_step"}


class PhaseClock:
    """The peak bytes and seconds of each phase; also the trainer's watchdog (``progress``), whose phase
    names say where the step is."""

    def __init__(self, tracker: LiveBytes, rules):
        self.tracker, self.rules, self.phases = tracker, rules, {}
        self.name, self.start = None, 0.0

    def enter(self, name: str | None) -> None:
        if name == self.name:
            return
        if self.name is not None:
            self.phases[self.name] = {"peak_bytes": self.tracker.peak, "live_after_bytes": self.tracker.live,
                                      "seconds": round(time.perf_counter() - self.start, 2)}
            print(f"rehearse: {self.name} done in {self.phases[self.name]['seconds']:.1f} s", file=sys.stderr,
                  flush=True)
        self.name, self.start = name, time.perf_counter()
        if name is not None:
            self.tracker.reset_peak()
            self.rules.phase = name

    def progress(self, iteration, phase: str, *io_budget) -> None:  # the watchdog's interface
        self.enter(STEP_PHASES.get(phase, self.name))


class FlexAttentionStandIn:
    """FlexAttention on fake CUDA tensors: ``create_block_mask`` checks its mask function on the device and
    holds the block indices a real mask holds; the attention checks the mask against the call (device,
    query/key lengths, heads, dtypes) and runs as a fused kernel (keeps the log-sum-exp). torch.compile
    (which FlexAttention needs on CUDA) does not run on fake CUDA tensors in this build."""

    def __init__(self, rules):
        self.rules = rules
        self.masks_created = 0

    def create_block_mask(self, mask_mod, B, H, Q_LEN, KV_LEN, device="cuda", BLOCK_SIZE=128, _compile=False):
        from megand.tools.device_rules import RehearsalError, source_line

        device = torch.device(device)
        if device.type != "cuda":
            raise RehearsalError(f"create_block_mask on {device} for a CUDA run (at {source_line()})")
        self.masks_created += 1
        n = min(Q_LEN, KV_LEN, BLOCK_SIZE)
        qi, ki = torch.arange(n, device=device)[:, None], torch.arange(n, device=device)[None, :]
        zero = torch.zeros((1, 1), dtype=torch.int64, device=device)  # batch and head indices, broadcast
        mask_mod(zero, zero, qi, ki)  # a CPU tensor inside the mask function fails here, as it would on the GPU
        qb, kb = -(-Q_LEN // BLOCK_SIZE), -(-KV_LEN // BLOCK_SIZE)
        b, h = B or 1, H or 1
        blocks = [torch.empty(b, h, qb, dtype=torch.int32, device=device),
                  torch.empty(b, h, qb, kb, dtype=torch.int32, device=device),
                  torch.empty(b, h, kb, dtype=torch.int32, device=device),
                  torch.empty(b, h, kb, qb, dtype=torch.int32, device=device)]
        return type("StandInBlockMask", (), {"seq_lengths": (Q_LEN, KV_LEN), "device": device,
                                             "BLOCK_SIZE": BLOCK_SIZE, "blocks": blocks})()

    def flex_attention(self, q, k, v, block_mask=None, scale=None, enable_gqa=False, **_):
        import torch.nn.functional as F

        from megand.tools.device_rules import RehearsalError, source_line

        where = source_line()

        def fail(message):
            raise RehearsalError(f"flex_attention: {message} (at {where})")

        if block_mask is not None:
            if tuple(block_mask.seq_lengths) != (q.shape[-2], k.shape[-2]):
                fail(f"a block mask made for {block_mask.seq_lengths[0]} x {block_mask.seq_lengths[1]} used on "
                     f"{q.shape[-2]} queries x {k.shape[-2]} keys")
            if block_mask.device != q.device:
                fail(f"a block mask on {block_mask.device} with queries on {q.device}")
        if len({q.dtype, k.dtype, v.dtype}) > 1:
            fail(f"q/k/v of different dtypes {q.dtype}/{k.dtype}/{v.dtype}")
        if q.shape[-1] != k.shape[-1]:
            fail(f"query and key head dims differ ({q.shape[-1]}, {k.shape[-1]})")
        if q.shape[1] != k.shape[1] and not (enable_gqa and q.shape[1] % k.shape[1] == 0):
            fail(f"{q.shape[1]} query heads with {k.shape[1]} key/value heads needs enable_gqa and a multiple")
        self.rules.attention("flex", where)
        self.rules.flex_depth += 1
        try:
            return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=enable_gqa)
        finally:
            self.rules.flex_depth -= 1

    def patches(self, stack: ExitStack) -> None:
        from unittest import mock

        import torch.nn.attention.flex_attention as flex

        from megand.core.transformer import documents

        stack.enter_context(mock.patch.object(flex, "create_block_mask", self.create_block_mask))
        stack.enter_context(mock.patch.object(documents, "_compiled_flex_attention", lambda: self.flex_attention))


def first_tile_draw(draw_region, rules):
    """The initialisation's ``draw_region`` drawing only the first tile of each region (fake tensors hold no
    values; drawing tens of thousands of tiles through the fake tensor mode takes minutes): that tile runs
    the real code, and its host syncs are counted once per tile of the region."""
    import math

    from megand.core.sharding import tile_shape

    def draw(meta, seed, name, region, out):
        if meta.init in ("ones", "zeros"):
            return draw_region(meta, seed, name, region, out)
        full, tile = meta.full_shape, tile_shape(meta.full_shape)
        bounds = [(r.start or 0, n if r.stop is None else r.stop) for r, n in zip(region, full)]
        tiles = math.prod(-(-hi // t) - lo // t for (lo, hi), t in zip(bounds, tile))
        first = tuple(slice(lo, min(hi, (lo // t + 1) * t)) for (lo, hi), t in zip(bounds, tile))
        since = len(rules.syncs)
        draw_region(meta, seed, name, first, out[tuple(slice(0, s.stop - s.start) for s in first)])
        rules.repeat_syncs(since, tiles - 1)

    return draw


class _NoStopSignal:
    """The trainer's stop vote in a rehearsal: no signal arrives (no handlers installed, no group made)."""

    def flag(self, limit_reached: bool = False) -> int:
        return 0


def trainer_for_rehearsal(cfg, configs, topo, data, clock):
    """A :class:`Trainer` holding what ``train_step`` reads, built without its run set-up (no data files,
    logs, checkpointer or wandb); the model, engine and optimizer are built in the ``build`` phase."""
    from megand.core.optimizer import Optimizer
    from megand.core.pipeline_parallel import get_schedule
    from megand.core.timing import device_timer
    from megand.training.feeds import RandomAccessFeed
    from megand.training.guards import SkipGuard, SpikeDetector
    from megand.training.pretrain import Trainer, build_model_and_engine
    from megand.training.rampup import batch_ramp

    trainer = Trainer.__new__(Trainer)
    trainer.cfg, trainer.configs, trainer.model_cfg = cfg, configs, configs.model
    trainer.topo = topo
    clock.enter("build")
    trainer.chunks, trainer.ddp = build_model_and_engine(configs, topo)
    trainer.named_params = [(n, p) for chunk in trainer.chunks for n, p in chunk.named_parameters()]
    trainer.params = [p for _, p in trainer.named_params]
    trainer.optimizer = Optimizer(trainer.named_params, configs.optimizer, topo, trainer.ddp)
    trainer.compile_timer, trainer.schedule = None, get_schedule(topo, schedule=configs.layout.pp_schedule)
    trainer.ramp = batch_ramp(cfg.train)
    trainer._plan_batches(cfg.train.global_batch_size)
    trainer.train_feed = RandomAccessFeed(data, topo, cfg.train.micro_batch_size, trainer.batch_needs, trainer.ramp)
    trainer.valid_feed = None
    trainer.iteration = trainer.consumed_samples = 0
    trainer.loaded_iteration = trainer.last_save_attempt = trainer.checkpointer = None
    trainer.skips = SkipGuard(cfg.train.max_skipped_steps)
    trainer.spikes = SpikeDetector(cfg.train.spike_factor, cfg.train.spike_window)
    trainer.rollbacks, trainer.busy, trainer.watchdog = 0, device_timer(topo.device), clock
    trainer.stop, trainer.started = _NoStopSignal(), time.monotonic()
    trainer.last_batch_checksum = None
    return trainer


def moe_reads_allowed(cfg, chunks, microbatches: int) -> int:
    """MoE's documented host reads per step: one per expert-parallel MoE layer and micro-batch (twice
    in the layers that fully recompute, whose forward runs again)."""
    from megand.core.expert_parallel.dispatcher import AllToAllDispatcher

    return microbatches * sum((2 if layer.cfg.recompute == "full" else 1)
                              * sum(isinstance(getattr(m, "dispatcher", None), AllToAllDispatcher) for m in layer.modules())
                              for c in chunks for layer in c.layers.values())


def rehearse(cfg, world: int, rank: int, device_kind: str = "cpu", profile: str = "h100") -> dict:
    """Build rank ``rank`` and run one training step on fake tensors: peak bytes and seconds per phase,
    and (on ``cuda``, as on the GPU ``profile`` of megand.tools.rehearsal_devices) the step's host syncs,
    the attention kernels, the kernel fallbacks and the process groups created."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megand.core import sharding
    from megand.core.checkpointing import sharded
    from megand.core.checkpointing.staging import HostStaging
    from megand.core.parallel_state import init_fake_distributed
    from megand.data.mock import MockGPTDataset
    from megand.tools.device_rules import DeviceRules, RehearsalError
    from megand.tools.fake_nccl import NcclRules
    from megand.tools.kernel_fallbacks import KernelFallbacks
    from megand.tools.rehearsal_devices import DEVICES
    from megand.training.config import ConfigError, check_fp8_device
    from megand.training.core_configs import core_configs
    from megand.training.pretrain import build_topology

    from unittest import mock

    cuda = device_kind == "cuda"
    device = init_fake_distributed(rank, world)
    if cuda:
        device = torch.device("cuda", rank % DEVICES_PER_NODE)
    gpu = DEVICES[profile]
    # a GPU's memory: its own tensors
    tracker, rules = LiveBytes("cuda" if cuda else None), DeviceRules(device, gpu if cuda else None)
    clock, nccl, flex = PhaseClock(tracker, rules), NcclRules(), FlexAttentionStandIn(rules)
    fallbacks = KernelFallbacks(gpu)
    class Fakes(FakeTensorMode):
        # host data given to torch.tensor(..., device=cuda) is made on the CPU and lifted, never asked of
        # the (absent) CUDA backend, even while the runtime stand-in says CUDA is available
        avoid_device_init = property(lambda self: True)

    fake_mode = Fakes(allow_non_fake_inputs=True)
    try:
        with ExitStack() as stack:
            if cuda:
                from megand.tools.fake_cuda import CudaRuntime

                stack.enter_context(CudaRuntime(gpu.name, int(gpu.reported_gib * 2**30), rules.sync,
                                                lambda: tracker.live, lambda: tracker.peak, tracker.reset_peak,
                                                capability=gpu.capability, sms=gpu.sms))
                try:  # what a run's start-up refuses on this GPU (the parent checked the config on its CPU)
                    check_fp8_device(cfg.train.get("fp8"), device)
                except ConfigError as e:
                    raise RehearsalError(str(e))
                stack.enter_context(nccl)
                flex.patches(stack)
                fallbacks.patches(stack)
                stack.enter_context(mock.patch.object(sharding, "draw_region", first_tile_draw(sharding.draw_region,
                                                                                              rules)))
                stack.enter_context(mock.patch.object(torch.nn.functional, "scaled_dot_product_attention",
                                                      rules.scaled_dot_product_attention))
                stack.enter_context(mock.patch.object(torch.nn.functional, "rms_norm", rules.rms_norm))
            configs = core_configs(cfg, device, world)  # the one reading of the run config, as a run's start-up does
            topo = build_topology(configs, device)
            t, m = cfg.train, configs.model
            data = MockGPTDataset(m.seq_length, m.vocab_size, configs.seed, t.global_batch_size)
            stack.enter_context(fake_mode)
            stack.enter_context(tracker)
            stack.enter_context(rules)
            trainer = trainer_for_rehearsal(cfg, configs, topo, data, clock)
            try:
                trainer.train_step()  # its progress marks move the clock to forward_backward, optimizer_step
                clock.enter("checkpoint_state_dict")
                state = HostStaging().stage(sharded.save_pieces(trainer.named_params, trainer.optimizer), copy=False)
                del state
                clock.enter(None)
            finally:
                trainer.train_feed.close()
        micro = topo.layout.microbatches(t.global_batch_size, t.micro_batch_size)
        log_step = int(t.log_interval == 1)  # the rehearsed step (iteration 0) synchronises if it is logged
        step = ("forward_backward", "optimizer_step")
        result = {"phases": clock.phases, "local_params": sum(p.numel() for p in trainer.params),
                  "microbatches": micro}
        if cuda:
            result.update(
                syncs={"step": rules.step_syncs(step),
                       "allowed": 1 + log_step + moe_reads_allowed(cfg, trainer.chunks, micro),
                       "per_line": rules.sync_table(step), "build": rules.sync_table(("build",)),
                       "checkpoint": rules.sync_table(("checkpoint_state_dict",))},
                attention=[{"backend": b, "where": w, "calls": n} for (b, w), n in sorted(rules.backends.items())],
                kernels=[{"kernel": k, "where": w, "calls": n} for (k, w), n in sorted(rules.kernels.items())],
                warnings=fallbacks.report(rules.kernels),
                block_masks_created=flex.masks_created, groups_created=nccl.groups_created)
        return result
    finally:
        dist.destroy_process_group()


def fused_attention_ran(result: dict) -> bool:
    """Whether every attention call site ran a kernel that keeps no ``s x s`` probabilities."""
    backends = [a["backend"] for a in result.get("attention", [])]
    return bool(backends) and not any(b.endswith("math") for b in backends)


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.2f} MiB"


def format_report(cfg, world: int, rank: int, result: dict, estimate: dict) -> str:
    from megand.core.parallel_layout import ParallelLayout

    p = cfg.parallel
    layout = ParallelLayout.from_keys(p, world)
    coords = layout.coords(rank)
    width = layout.stage_tp_of(coords["pp"])  # with stages of different widths: its stage's own
    lines = [f"rank {rank}/{world} on {result['device']}: tp {coords['tp']}/{width} cp {coords['cp']}/{p.cp} "
             f"dp {coords['dp']} pp {coords['pp']}/{p.pp} vpp {p.vpp}; {result['local_params']:,} parameters; "
             f"{result['microbatches']} micro-batches of {cfg.train.micro_batch_size} x {cfg.model.seq_length} tokens, "
             f"{cfg.train.precision}",
             f"{'phase':<24}{'peak (rehearsed)':>18}{'estimator':>14}{'ratio':>8}{'seconds':>9}"]
    for name in PHASES:
        ph, est = result["phases"][name], estimate[name]
        lines.append(f"{name:<24}{_gib(ph['peak_bytes']):>18}{_gib(est):>14}{ph['peak_bytes'] / est:>8.2f}"
                     f"{ph['seconds']:>9.1f}")
    steady = result["phases"]["forward_backward"]["peak_bytes"]
    over = [n for n in PHASES if result["phases"][n]["peak_bytes"] > 1.1 * steady]
    lines.append(f"steady peak (forward_backward) {_gib(steady)}; phases above it by more than 10%: "
                 f"{', '.join(over) if over else 'none'}; estimator with "
                 f"{'fused' if result['estimator_fused_attention'] else 'unfused'} attention")
    highest = max(PHASES, key=lambda n: result["phases"][n]["peak_bytes"])
    lines.append(f"plan on: {_gib(result['phases'][highest]['peak_bytes'])} ({highest}), the highest rehearsed peak: it "
                 f"counts every tensor this rank really allocates (weights, gradients, optimizer state, activations, "
                 f"communication buffers and temporaries); tools/estimate.py's figure is a formula of the main terms, "
                 f"for comparing layouts before rehearsing, and leaves out allocator rounding and short-lived buffers")
    if "syncs" in result:
        s = result["syncs"]
        lines.append(f"host syncs in the step: {s['step']} (allowed {s['allowed']})")
        lines += [f"  {x['count']:>4} x {x['kind']:<44} {x['where']}" for x in s["per_line"]]
        if s["build"]:
            lines.append(f"host syncs while building: {sum(x['count'] for x in s['build'])} "
                         f"(most: {s['build'][0]['count']} x {s['build'][0]['kind']} at {s['build'][0]['where']})")
        lines.append("attention kernels: " + ("; ".join(f"{a['backend']} x{a['calls']} at {a['where']}"
                                                         for a in result["attention"]) or "none"))
        lines.append("CUDA-only GEMMs: " + ("; ".join(f"{k['kernel']} x{k['calls']} at {k['where']}"
                                                      for k in result["kernels"]) or "none"))
        lines.append(f"FlexAttention block masks created in the step: {result['block_masks_created']}; "
                     f"process groups created: {result['groups_created']}")
    if "warnings" in result:
        lines.append("kernel fallbacks: " + ("none" if not result["warnings"] else "(warnings: the rank runs, slower)"))
        lines += [f"  warning: {w['count']:>4} x {w['warning']} at {w['where']}" for w in result["warnings"]]
    if "fit" in result:
        f = result["fit"]
        verdict = "yes" if f["fits"] else "NO (within the margin)" if f["within_margin"] else "NO"
        room = max(f["device_memory_bytes"] - f["margin_bytes"], 0)
        lines.append(f"fit: {verdict}: peak {_gib(f['peak_bytes'])} ({f['phase']}) of {_gib(f['device_memory_bytes'])} "
                     f"usable, less a margin of {_gib(f['margin_bytes'])}: {_gib(room)}")
    return "\n".join(lines)


def failures(result: dict) -> list[str]:
    """One line per reason this rank would not run well on the device (exit status 1)."""
    lines = []
    if "syncs" in result and result["syncs"]["step"] > result["syncs"]["allowed"]:
        s = result["syncs"]
        top = s["per_line"][0]
        lines.append(f"rehearse: {s['step']} host syncs in the step, {s['allowed']} allowed (most: {top['count']} x "
                     f"{top['kind']} at {top['where']})")
    if "fit" in result and not result["fit"]["fits"]:
        f = result["fit"]
        room = max(f["device_memory_bytes"] - f["margin_bytes"], 0)
        lines.append(f"rehearse: rank {result['rank']} does not fit: {f['phase']} peaks at {_gib(f['peak_bytes'])} "
                     f"({f['peak_bytes']:,} bytes), the device holds {_gib(f['device_memory_bytes'])} usable"
                     + (f", within the margin of {_gib(f['margin_bytes'])} kept below it (a fit is at most "
                        f"{_gib(room)})" if f["within_margin"] else ""))
    return lines


def main(argv=None) -> None:
    args = parse_args(argv)
    cfg, world, _ = prepare_config(args)  # bad input fails here, before any work
    if args.device == "cuda":
        from megand.tools import fake_cuda

        if not fake_cuda.runtime_loaded():  # the runtime stand-in must be loaded before torch: a child
            try:
                proc = fake_cuda.run_child("megand.tools.rehearse:main", list(sys.argv[1:] if argv is None else argv))
            except fake_cuda.RuntimeUnavailable as e:
                raise SystemExit(f"rehearse: {e}")
            if proc.returncode:
                raise SystemExit(proc.returncode)
            return
    from megand.core.parallel_layout import ParallelLayout
    from megand.tools.device_rules import RehearsalError

    from megand.tools.progress import heartbeat
    from megand.tools.rehearsal_devices import DEVICES, fit_verdict

    memory = int(args.device_memory_gib * 2**30)
    try:
        with heartbeat(f"rehearse: building and stepping rank {args.rank} on {args.device}"):
            result = rehearse(cfg, world, args.rank, args.device, args.device_profile)
    except RehearsalError as e:
        raise SystemExit(f"rehearse: rank {args.rank} fails on {args.device}: {e}")
    stage = ParallelLayout.from_keys(cfg.parallel, world).coords(args.rank)["pp"]
    fused = fused_attention_ran(result)
    estimate = estimator_phases(cfg, world, stage, fused_attention=fused)
    result.update(rank=args.rank, world_size=world, stage=stage, estimator_fused_attention=fused,
                  device=(f"cuda ({args.device_profile}, {DEVICES[args.device_profile].sm}, "
                          f"{args.device_memory_gib:g} GiB usable)" if args.device == "cuda" else "cpu"))
    if args.device == "cuda":
        result["fit"] = fit_verdict(result["phases"], memory)
    if args.json:
        print(json.dumps({**result, "estimate_bytes": estimate}))
    else:
        print(format_report(cfg, world, args.rank, result, estimate), flush=True)
    problems = failures(result)
    if problems:
        raise SystemExit("\n".join(problems))
