"""Rehearse one rank of any layout on one CPU: build it, run one training step, and report the peak bytes
of each phase next to the memory estimator's prediction.

    python tools/rehearse.py +experiment=llama70b_64gpu --world-size 64 --rank 0
    python tools/rehearse.py +experiment=llama8b_8gpu --world-size 8 --rank 0 --json

The overrides are the training config's (Hydra, as for ``pretrain_gpt.py``). This process plays rank
``--rank`` of a world of ``--world-size`` ranks (default tp*pp*cp*(dp or 1), as tools/estimate.py) on
torch's fake process group (collectives return at once, no other process exists), and every tensor is a
fake tensor (shape, dtype and device, no memory), so a 70B layout rehearses in a few GiB of host RAM.
A dispatch mode counts the bytes of the storages alive after every operation; each phase reports the
peak of that count (everything this rank holds, e.g. parameters during forward, included):

- ``build``: the model built on the meta device, the engine's parameter and gradient buffers, the
  tile-wise initialisation and the optimizer's states;
- ``forward_backward``: the schedule over this rank's micro-batches, then the gradient reduction;
- ``optimizer_step``: global norm, clipping, AdamW, write-back and parameter all-gather (the norm is
  not read: fake tensors hold no values);
- ``checkpoint_state_dict``: the state dict a checkpoint save hands to torch.distributed.checkpoint
  (model pieces and the optimizer's per-parameter states), built but not written.

The estimator (megand/tools/estimate_memory.py) predicts states for build and the optimizer step, and
states plus activations for forward_backward. The number of micro-batches per dp rank is cut to the
fewest that reach the schedule's steady state (2 without a pipeline, pp for 1F1B, 2*pp interleaved;
``--microbatches`` overrides): more only repeat it. The data are mock tokens (no files are read).

The operations are torch's CPU implementations. Where they store more than the CUDA kernels the
forward_backward peak is above a GPU run's: ``F.rms_norm`` on bf16 (no fused CPU kernel) keeps two fp32
tensors of its input's size (8 bytes per element instead of 2), e.g. ~8.6 GiB more on the first stage of
llama70b_64gpu. The checkpoint files themselves are not written.

Private torch APIs used (no public equivalent in torch 2.13): the fake process group
(``torch.testing._internal.distributed.fake_pg``, via megand.core.parallel_state.init_fake_distributed)
and ``torch._subclasses.fake_tensor.FakeTensorMode``; the byte count uses the public
``torch.utils._python_dispatch.TorchDispatchMode`` (documented, underscore module).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import weakref

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

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._alive: dict[int, list] = {}  # id(storage) -> [weak reference, bytes counted]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves((out, args, kwargs)):
            if isinstance(t, torch.Tensor):
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


class ScalarReadsAsOne(TorchDispatchMode):
    """Reading a fake tensor's value (``.item()``) gives 1: AdamW on the CPU reads its step counts for
    the bias correction. Fake tensors have no values; nothing else in a step reads one (the global norm
    is left unread by the rehearsal)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            return True if args[0].dtype == torch.bool else 1
        return func(*args, **(kwargs or {}))


def steady_microbatches(pp: int, vpp: int | None) -> int:
    """Micro-batches per dp rank that reach the schedule's steady state (peak activations in flight)."""
    if pp == 1:
        return 2  # the second repeats the first with the gradients already accumulating
    return 2 * pp if vpp and vpp > 1 else pp


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for pretrain_gpt.py (key=value, model=NAME)")
    p.add_argument("--rank", type=int, default=0, help="the global rank to rehearse")
    p.add_argument("--world-size", type=int, default=None, help="ranks of the run (default: tp*pp*cp*(dp or 1))")
    p.add_argument("--microbatches", type=int, default=None,
                   help="micro-batches per dp rank (default: the fewest that reach the schedule's steady state)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p.parse_intermixed_args(argv)


def prepare_config(args):
    """The composed config with the rehearsal's changes: mock data, the cut global batch, no checkpoints."""
    from megand.training.config import ConfigError, compose, validate

    cfg = compose(args.overrides)
    p, t = cfg.parallel, cfg.train
    world = args.world_size or p.tp * p.pp * p.cp * (p.dp or 1)
    if world % (p.tp * p.pp * p.cp):
        raise SystemExit(f"rehearse: world size {world} is not divisible by tp*pp*cp = {p.tp}*{p.pp}*{p.cp}")
    dp = world // (p.tp * p.pp * p.cp)
    if not 0 <= args.rank < world:
        raise SystemExit(f"rehearse: --rank {args.rank} is not in a world of {world} ranks")
    configured = t.global_batch_size // (t.micro_batch_size * dp)
    micro = args.microbatches or min(max(configured, 1), steady_microbatches(p.pp, p.vpp))
    t.global_batch_size = micro * t.micro_batch_size * dp
    cfg.data.kind = "mock"
    cfg.checkpoint.save = cfg.checkpoint.load = None
    try:
        validate(cfg, world)
    except ConfigError as e:
        raise SystemExit(f"rehearse: invalid configuration for world size {world}: {e}")
    return cfg, world, micro


def estimator_phases(cfg, world: int, stage: int) -> dict:
    """The estimator's prediction for this rank's pipeline stage, per phase."""
    from megand.tools.estimate_memory import Layout, estimate_memory

    model = OmegaConf.to_container(cfg.model, resolve=True)
    layout = Layout.from_config(cfg.parallel, cfg.train, cfg.optim, world_size=world)
    st = estimate_memory(model, layout, stages=[stage]).stages[0]
    states = st.param_bytes + st.grad_bytes + st.optimizer_bytes
    return {"build": states, "forward_backward": st.total_bytes, "optimizer_step": states,
            "checkpoint_state_dict": states}


def rehearse(cfg, world: int, rank: int) -> dict:
    """Build rank ``rank`` and run one step on fake tensors; peak bytes and seconds per phase."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megand.core.checkpointing import sharded
    from megand.core.optimizer import Optimizer
    from megand.core.parallel_state import init_fake_distributed
    from megand.core.pipeline_parallel import get_schedule
    from megand.data.mock import MockGPTDataset
    from megand.training.batches import rank_microbatches
    from megand.training.config import optimizer_config
    from megand.training.pretrain import build_model_and_engine, build_topology

    device = init_fake_distributed(rank, world)
    try:
        topo = build_topology(cfg, device)
        t, m = cfg.train, cfg.model
        tracker, phases = LiveBytes(), {}

        def phase(name, fn):
            tracker.reset_peak()
            start = time.perf_counter()
            result = fn()
            phases[name] = {"peak_bytes": tracker.peak, "live_after_bytes": tracker.live,
                            "seconds": round(time.perf_counter() - start, 2)}
            print(f"rehearse: {name} done in {phases[name]['seconds']:.1f} s", file=sys.stderr, flush=True)
            return result

        data = MockGPTDataset(m.seq_length, m.vocab_size, t.seed, t.global_batch_size)
        with FakeTensorMode(allow_non_fake_inputs=True), tracker, ScalarReadsAsOne():
            def build():  # model, engine buffers, initialisation, optimizer states
                _, chunks, ddp = build_model_and_engine(cfg, topo)
                named = [(n, p) for c in chunks for n, p in c.named_parameters()]
                return chunks, ddp, named, Optimizer(named, optimizer_config(cfg), topo, ddp)

            chunks, ddp, named, optimizer = phase("build", build)
            needs_tokens = any(c.pre_process or c.post_process for c in chunks)
            microbatches = rank_microbatches(data, 0, t.global_batch_size, t.micro_batch_size, topo,
                                             seq_length=m.seq_length, needs_tokens=needs_tokens)
            tokens = t.global_batch_size * m.seq_length
            schedule = get_schedule(topo)

            def forward_step(model, mb, hidden):
                out = model(input_ids=mb.input_ids if model.pre_process else None, positions=mb.positions,
                            labels=mb.labels if model.post_process else None, hidden=hidden)
                return optimizer.scale_loss(out.float().sum() / tokens) if model.post_process else out

            def forward_backward():
                for c in chunks:
                    c.train()
                optimizer.zero_grad()
                schedule(chunks, microbatches, forward_step, topo, grad_sync=ddp)
                ddp.finish_grad_sync()

            phase("forward_backward", forward_backward)

            def optimizer_step():
                optimizer.prepare_grads()
                optimizer.update(grad_norm=1.0, lr=optimizer.schedule(1))
                ddp.finish_param_sync()

            phase("optimizer_step", optimizer_step)
            state = phase("checkpoint_state_dict", lambda: sharded.save_pieces(named, optimizer, copy=False))
            del state
        return {"phases": phases, "local_params": sum(p.numel() for _, p in named),
                "microbatches": len(microbatches)}
    finally:
        dist.destroy_process_group()


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.2f} MiB"


def format_report(cfg, world: int, rank: int, result: dict, estimate: dict) -> str:
    from megand.core.parallel_state import ParallelSizes, rank_coords

    p = cfg.parallel
    coords = rank_coords(rank, ParallelSizes.infer(world, tp=p.tp, pp=p.pp, cp=p.cp, dp=p.dp), p.order)
    lines = [f"rank {rank}/{world}: tp {coords['tp']}/{p.tp} cp {coords['cp']}/{p.cp} dp {coords['dp']} "
             f"pp {coords['pp']}/{p.pp} vpp {p.vpp}; {result['local_params']:,} parameters; "
             f"{result['microbatches']} micro-batches of {cfg.train.micro_batch_size} x {cfg.model.seq_length} tokens",
             f"{'phase':<24}{'peak (rehearsed)':>18}{'estimator':>14}{'ratio':>8}{'seconds':>9}"]
    for name in PHASES:
        ph, est = result["phases"][name], estimate[name]
        lines.append(f"{name:<24}{_gib(ph['peak_bytes']):>18}{_gib(est):>14}{ph['peak_bytes'] / est:>8.2f}"
                     f"{ph['seconds']:>9.1f}")
    steady = result["phases"]["forward_backward"]["peak_bytes"]
    over = [n for n in PHASES if result["phases"][n]["peak_bytes"] > 1.1 * steady]
    lines.append(f"steady peak (forward_backward) {_gib(steady)}; phases above it by more than 10%: "
                 f"{', '.join(over) if over else 'none'}")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    cfg, world, _ = prepare_config(args)
    result = rehearse(cfg, world, args.rank)
    from megand.core.parallel_state import ParallelSizes, rank_coords

    p = cfg.parallel
    stage = rank_coords(args.rank, ParallelSizes.infer(world, tp=p.tp, pp=p.pp, cp=p.cp, dp=p.dp), p.order)["pp"]
    estimate = estimator_phases(cfg, world, stage)
    if args.json:
        print(json.dumps({"rank": args.rank, "world_size": world, "stage": stage, **result,
                          "estimate_bytes": estimate}))
    else:
        print(format_report(cfg, world, args.rank, result, estimate))
