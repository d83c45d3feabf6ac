"""The training run: config -> topology -> model -> schedule -> optimizer -> logs, as named steps."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import json
import math
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from megand.core.checkpointing import CheckpointError, StopOnSignal
from megand.core.distributed import DataParallel
from megand.core.metrics import MAX, RANKS, Metric, reduce_metrics
from megand.core.optimizer import Optimizer
from megand.core.optimizer.optimizer import StepResult
from megand.core.parallel_state import (
    Topology,
    choose_device_and_backend,
    device_capability,
    init_distributed,
)
from megand.core.batch_shares import lockstep_microbatches, step_microbatches
from megand.core.pipeline_parallel import get_schedule
from megand.core.sharding import init_flat_range, init_parameters
from megand.core.tensor_parallel import seed_random_streams
from megand.core.tensor_parallel.fp8 import Fp8Kernels, use_fp8, weights_cached
from megand.core.timing import device_timer
from megand.core.transformer import dsa, moe
from megand.core.sdpa import attention_summary
from megand.core.transformer.documents import DocumentMask
from megand.data.builder import build_datasets as build_data_splits
from megand.models.flops import flops_per_iteration, fp8_flops_fraction
from megand.models.gpt import GPTModel
from megand.training.agreement import USER_ERRORS, on_every_rank, raise_agreed
from megand.training.batches import loss_token_count, mtp_token_counts
from megand.training.compile import compile_layers
from megand.training.config import backend_timeout_s, collective_timeout_s, validate, validate_fault_keys
from megand.training.elastic import check_continuation
from megand.training.core_configs import CoreConfigs, DatasetPlan, core_configs
from megand.training.feeds import open_feed
from megand.training.guards import NonFiniteStop, SkipGuard, SpikeDetector, all_finite, first_nonfinite_grad
from megand.training.hang_report import enable_recorder
from megand.training.metrics import MetricsWriter, console_line
from megand.training.schedule_continuity import check_no_rewarm
from megand.training.output_dirs import check_output_dirs, check_run_dir_reuse
from megand.training.peak import device_peak_flops, machine_cache_dir, mfu
from megand.training.rampup import ConstantBatch, batch_ramp
from megand.training.resume import open_local_tier
from megand.training.save_failures import SaveFailures, SaveFailureStop
from megand.training.wandb_logger import WandbLogger


def build_topology(configs: CoreConfigs, device) -> Topology:
    """Collective: this rank's topology of the run's layout; its groups' collectives wait as long as the
    backend's timeout allows."""
    return Topology(configs.layout, device, backend_timeout_s(configs.collective_timeout_s))


def build_model(configs: CoreConfigs, topo, device=None) -> list[GPTModel]:
    """This rank's model chunks (one unless interleaved), initialised independently of the layout, and
    its random streams (the default generator and the chunks' shared tensor-parallel stream) seeded.

    ``device``: default ``topo.device``. On ``torch.device("meta")`` nothing is allocated nor initialised:
    the data-parallel engine places the parameters in its buffers, then :func:`init_parameters` fills them
    (what :class:`Trainer` does, so no rank ever holds a second copy of its parameters)."""
    # sequence parallelism is per stage where the stages have their own widths (parallel.pipeline_layout)
    model_cfg, fp8 = replace(configs.model, sequence_parallel=topo.sequence_parallel(configs.model.sequence_parallel)), configs.fp8
    rng = seed_random_streams(configs.seed, topo)
    chunks = []
    for spec in configs.pipeline.chunks(topo.pp_size, topo.pp_rank, topo.pp_schedule):
        chunk = GPTModel(model_cfg, topo, rng, spec.layer_ids, spec.pre_process, spec.post_process, device=device,
                         recompute_ids=configs.pipeline.recompute_ids)
        if fp8 is not None:
            use_fp8(chunk.layers, fp8.recipe, model_cfg.num_layers, fp8.bf16_layers,
                    Fp8Kernels.for_capability(device_capability(topo.device)))
        if device is None or torch.device(device).type != "meta":
            init_parameters(chunk, configs.seed)
        chunks.append(chunk)
    return chunks


def build_model_and_engine(configs: CoreConfigs, topo) -> tuple[list[GPTModel], DataParallel]:
    """The model chunks built on the meta device, placed in the data-parallel engine's flat buffers and
    initialised there: per rank, only the local shard is ever allocated and drawn (under ZeRO-3, only
    this rank's slices of it: the full local parameters exist only while gathered for a forward)."""
    chunks = build_model(configs, topo, device=torch.device("meta"))
    ddp = DataParallel(chunks, topo, configs.data_parallel)
    if ddp.shard_params:  # ZeRO-3: the rank holds only flat ranges of its parameters; draw just those
        name_of = {p: n for chunk in chunks for n, p in chunk.named_parameters()}
        for p, lo, hi, data in ddp.param_shards():
            init_flat_range(p, name_of[p], configs.seed, lo, hi, data)
    else:
        for chunk in chunks:
            init_parameters(chunk, configs.seed)
    return chunks, ddp


def build_datasets(plan: DatasetPlan, topo, extra_train_samples: int = 0):
    """Train and validation datasets. Index files are cached in ``data.cache_dir``: global rank 0 builds
    them first; then the first rank of every other node (which loads rank 0's files when the filesystem
    is shared, or builds its own on a node-local disk); then every other rank, which loads its node's.
    Writes are atomic (private name, then rename), so even a concurrent build cannot be read half-done.
    A bad input found in any phase stops every rank at the end of that phase, with the same message."""
    num_samples = (plan.train_samples + extra_train_samples, plan.valid_samples, 0)
    turn = 0 if topo.rank == 0 else 1 if topo.local_rank == 0 else 2
    for phase in range(3):
        error = None
        if phase == turn:
            try:
                train, valid, _ = build_data_splits(plan.data, plan.seq_length, plan.vocab_size, plan.seed, num_samples)
            except USER_ERRORS as e:
                error = e
        raise_agreed(error)  # also the barrier between the phases
    return train, valid


def peak_memory_bytes(device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def new_wandb_run_id() -> str:
    """A fresh wandb run id, drawn on rank 0 and the same on every rank (collective)."""
    import secrets

    box = [secrets.token_hex(4) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Trainer:
    """Holds what the steps of a run share; each method is one named step of the loop.

    ``wandb_run_id`` (every rank holds the same): store it in checkpoints; passing it back
    (``Trainer(cfg, wandb_run_id=...)``, or setting ``trainer.wandb_run_id`` before the first log) makes a
    resumed run continue the same wandb run.
    """

    def __init__(self, cfg, wandb_run_id: str | None = None, adopt_model=None):
        """``adopt_model(saved)``: makes ``cfg.model`` the model of the checkpoint the run starts from
        (``saved``: its model section when it is a state of the local tier; None: read ``checkpoint.load``)."""
        self.cfg = cfg
        # the collective timeout reaches the backend (NCCL's own 10-minute default would fire first), a
        # little after the watchdog's, which reports where each rank is
        enable_recorder(cfg.train.hang_report_ops)  # before the first process group: the hang report's record
        device = init_distributed(backend_timeout_s(collective_timeout_s(cfg, choose_device_and_backend()[0])))
        # the node-local tier and the local state a restart starts from, chosen first: the run's model may be
        # that state's, and a restore from the local tier reads nothing of the shared tier but `latest`
        on_every_rank(lambda: validate_fault_keys(cfg))
        self.local_tier, self.local_start, self.local_notes = open_local_tier(cfg)
        if adopt_model is not None:
            on_every_rank(lambda: adopt_model(self.local_start.meta.get("model") if self.local_start else None))
        # before any work: the values, then the directories the run must be able to write
        # an elastic restart (its own checkpoint, another world size) changes only dp (megand/training/elastic.py);
        # a local state is of this world size (LocalTier.choose), so it is never one
        elastic = None if self.local_start else on_every_rank(lambda: check_continuation(cfg, dist.get_world_size()))
        on_every_rank(lambda: validate(cfg, dist.get_world_size()))
        if elastic and dist.get_rank() == 0:
            print(elastic, flush=True)
        on_every_rank(lambda: check_output_dirs(cfg))
        on_every_rank(lambda: check_run_dir_reuse(cfg))
        # the one reading of the Hydra config for core: every builder below takes its typed piece of it
        self.configs = core_configs(cfg, device, dist.get_world_size())
        self.model_cfg = self.configs.model
        self.topo = build_topology(self.configs, device)
        # data before the model: a bad dataset fails before any model memory is spent (numpy RNGs of its
        # own: the order changes no random stream); the train split also covers what spike rollbacks may skip
        train, valid = build_datasets(self.configs.datasets, self.topo, self.rollback_sample_budget())
        # params live in the engine's buffers, allocated and initialised there (no full copy)
        self.chunks, self.ddp = build_model_and_engine(self.configs, self.topo)
        self.named_params = [(n, p) for chunk in self.chunks for n, p in chunk.named_parameters()]
        self.params = [p for _, p in self.named_params]
        self.optimizer = Optimizer(self.named_params, self.configs.optimizer, self.topo, self.ddp)
        self.compile_timer = compile_layers(self.chunks) if cfg.train.compile else None
        self.schedule = get_schedule(self.topo, schedule=self.configs.layout.pp_schedule)
        self.ramp = batch_ramp(cfg.train)  # the global batch of each step (train.rampup_batch_size)
        self._plan_batches(cfg.train.global_batch_size)
        self.iteration, self.consumed_samples = 0, 0  # consumed: true samples, also after batch-size changes
        self.train_feed, self.valid_feed = self._open_feeds(train, valid)
        self.loaded_iteration = self.last_save_attempt = None
        self.rollback_path = None  # the checkpoint a spike rollback returns to: the one loaded or saved last
        self.spikes = SpikeDetector(cfg.train.spike_factor, cfg.train.spike_window)
        self.rollbacks = 0
        self.wandb_run_id = wandb_run_id or new_wandb_run_id()  # a loaded checkpoint's id replaces it
        self._wandb = None  # started on first use, after a checkpoint may have set wandb_run_id
        self.checkpointer = self._build_checkpointer()
        local = self.checkpointer.local if self.checkpointer is not None else None
        if local is not None and not local.replicated and self.topo.is_logging_rank:
            print(f" checkpoint.local_dir: every rank is on one node, so the local tier has no peer node to replicate "
                  f"to: it survives restarts of the processes, not the loss of the node", flush=True)
        self.save_failures = SaveFailures(cfg.checkpoint.max_failed_saves, cfg.checkpoint.continue_on_error,
                                          self._report_save_failure)
        self.stop = StopOnSignal()
        self.agreed_stop = None  # the ranks' stop decision, taken with the last step's all-reduce
        self.best_val = float("inf")  # the best validation loss of this run so far
        self.restored = None  # the state this run started from (LoadedState), reported once the logs are open
        if cfg.checkpoint.load:
            self.resume()
        if self.checkpointer is not None and self.checkpointer.local is not None and self.topo.local_rank == 0:
            # local iterations past this run's start are another trajectory's: never restored later
            start = self.iteration
            self.checkpointer.local.remove(lambda it: it > start)
        # a smaller global batch size resumes further into the data than the run was built for
        self.train_feed.reserve(self.consumed_samples + (cfg.train.iters - self.iteration) * cfg.train.global_batch_size
                                + self.rollback_sample_budget())
        # this process's steps and samples, for the summary; the loaded checkpoint's iteration (0: fresh)
        self.run_steps = self.run_samples = 0
        self.resumed_from = self.iteration
        self.skips = SkipGuard(cfg.train.max_skipped_steps)
        self.busy = device_timer(self.topo.device)  # this rank's time in forward/backward since the last log line
        self._open_logs()
        self._report_restore()

    @property
    def train_data(self):
        """The train split's source, as its feed reads it (built again by a resume that reads further)."""
        return self.train_feed.source

    def _open_feeds(self, train, valid):
        """The feeds of the train and validation splits (:mod:`megand.training.feeds`): the trainer reads every
        data source through them. Collective (a stream's feed makes its process groups)."""
        t, plan = self.cfg.train, self.configs.datasets
        kind = plan.data.get("kind", "mock")

        def rebuild(samples: int):
            return build_datasets(plan, self.topo, samples - plan.train_samples)[0]

        return (open_feed(kind, train, self.topo, t.micro_batch_size, self.batch_needs, self.ramp,
                          plan.train_samples + self.rollback_sample_budget(), rebuild),
                open_feed(kind, valid, self.topo, t.micro_batch_size, self.batch_needs,
                          ConstantBatch(t.global_batch_size)))

    def rollback_sample_budget(self) -> int:
        """Samples a run may skip by spike rollbacks: each skips at most one checkpoint interval of batches."""
        t, c = self.cfg.train, self.cfg.checkpoint
        return t.max_rollbacks * c.interval * t.global_batch_size if t.spike_rollback else 0

    def _plan_batches(self, global_batch_size: int):
        """What each step reads and computes: tokens per global batch, FLOPs, whether this rank reads tokens."""
        cfg = self.cfg
        self.batch_size = global_batch_size  # of the step being run (a batch-size ramp-up changes it)
        self.tokens_per_batch = global_batch_size * cfg.model.seq_length
        # stages with neither the embedding, the loss nor per-layer input embeddings read no tokens
        needs_tokens = any(chunk.reads_tokens or chunk.post_process for chunk in self.chunks)
        self.has_loss = any(chunk.post_process for chunk in self.chunks)
        self.batch_needs = dict(seq_length=cfg.model.seq_length, needs_tokens=needs_tokens,
                                documents=self.configs.documents)
        self.loss_tokens = self.tokens_per_batch  # per global batch: fewer with data.eod_mask_loss
        self.flops = flops_per_iteration(cfg.model, global_batch_size, cfg.train.recompute,
                                         tp=self.topo.tp_size, recomputed_layers=self.configs.pipeline.recompute_ids)  # the padded vocabulary's logits

    def _build_checkpointer(self):
        cfg = self.cfg
        if not (cfg.checkpoint.save or cfg.checkpoint.load):
            return None
        from megand.core.checkpointing import Checkpointer

        return Checkpointer(self.configs.checkpoint, self.topo, self.named_params, self.optimizer, self.chunks,
                            OmegaConf.to_yaml(cfg, resolve=True), OmegaConf.to_container(cfg.model, resolve=True),
                            local=self.local_tier)

    def _open_logs(self):
        """metrics.jsonl (appended to after a resume), the MFU denominator and the run's config file."""
        cfg, logging_rank = self.cfg, self.topo.is_logging_rank
        self.writer = MetricsWriter(cfg.run_dir, logging_rank, append=self.iteration > 0)
        self.started = time.monotonic()  # train.exit_duration_mins counts from here
        self.watchdog = None  # started by run()
        self.last_spike, self.last_loss = False, None
        self.last_batch_checksum = None  # train.batch_checksum: a device tensor, read when logged
        fp8 = self.configs.fp8
        fp8_layers = fp8.layer_count(self.model_cfg.num_layers) if fp8 is not None else 0
        self.peak_flops = device_peak_flops(
            self.topo.device, cfg.train.precision, cfg.run_dir, shared_dir=machine_cache_dir(),
            fp8_fraction=fp8_flops_fraction(OmegaConf.to_container(cfg.model, resolve=True), fp8_layers, self.topo.tp_size),
        ) if logging_rank else None
        if logging_rank:
            with open(os.path.join(cfg.run_dir, "config.yaml"), "w") as f:
                f.write(OmegaConf.to_yaml(cfg, resolve=True))

    def guard_state(self) -> dict:
        """What the checkpoint keeps of the guards: the rollback count and the spike window."""
        return {"rollbacks": self.rollbacks, "spike_window": list(self.spikes.recent)}

    def load_guard_state(self, extra: dict | None) -> None:
        """Restore :meth:`guard_state` (a checkpoint without it: no rollback yet, an empty window)."""
        extra = extra or {}
        self.rollbacks = int(extra.get("rollbacks", 0))
        self.spikes.recent.clear()
        self.spikes.recent.extend(extra.get("spike_window", []))

    def data_state(self) -> dict:
        """Collective: where the data stands after the batches trained on (what a checkpoint keeps)."""
        return self.train_feed.state_dict()

    def resume(self) -> None:
        """Collective: start from the newest state of ``checkpoint.load``, or of the node-local tier when this
        run resumes itself (``checkpoint.load`` = ``checkpoint.save``) and the tier holds a complete state at
        least as new (see megand/core/checkpointing/local_tier.py); otherwise as the requeue idiom says."""
        from megand.training.resume import load_path

        c = self.cfg.checkpoint
        path, notice = load_path(c)
        restored, notes = self.checkpointer.restore_local(self.local_start) if self.local_start else (None, [])
        if self.local_start and restored is None and not path:
            error = CheckpointError(f"checkpoint.local_dir: {(self.local_notes + notes)[-1]}, and {c.save} holds "
                                    f"no checkpoint to load instead")
            error.every_rank = True  # every rank agreed on the restore's outcome
            raise error
        if self.topo.is_logging_rank:
            lines = self.local_notes + notes
            for i, note in enumerate(lines):
                last = i == len(lines) - 1 and path and not restored
                print(f" checkpoint.local_dir: {note}" + ("; loading the shared tier" if last else ""), flush=True)
            if notice and restored is None:
                print(notice, flush=True)
        if self.local_start and restored is None and path:
            # the local state chosen before any work was passed over: the shared one is checked as usual (an
            # elastic continuation's rule), late but before it is loaded
            elastic = on_every_rank(lambda: check_continuation(self.cfg, dist.get_world_size()))
            if elastic and self.topo.is_logging_rank:
                print(elastic, flush=True)
        if restored is not None:
            self.load_checkpoint(None, restored)
        elif path:
            self.load_checkpoint(path)

    def _report_restore(self) -> None:
        """The ``checkpoint_restored`` event: which tier the run started from, the bytes read from each."""
        r = self.restored
        if r is None:
            return
        self.writer.write({"iter": r.iteration, "event": "checkpoint_restored", "tier": r.tier, "path": r.path,
                           "bytes_local": (r.bytes_read or {}).get("local", 0),
                           "bytes_shared": (r.bytes_read or {}).get("shared", 0), "seconds": round(r.seconds, 4),
                           "from_replica": list(r.from_replica)})

    def load_checkpoint(self, path, loaded=None):
        """Load the checkpoint at ``path`` (or take ``loaded``, a state already restored) and continue from it."""
        loaded = loaded or self.checkpointer.load(path)
        self.restored = loaded
        # a spike rollback reloads from the shared tier: its newest checkpoint, when the local tier was newer
        self.rollback_path = loaded.path if loaded.tier == "shared" else self._shared_latest()
        self.load_guard_state(loaded.extra_state)
        notice = self.train_feed.load_state_dict((loaded.extra_state or {}).get("data"))
        if notice and self.topo.is_logging_rank:
            print(f" {loaded.path} {notice}", flush=True)
        if self.loaded_iteration is None:  # the run's first load (a rollback reloads under the same schedule)
            # a local state carries its config (the shared tier's is its config.yaml); the checkpoints of a
            # schedule's stable phase to extend from are the shared tier's
            check_no_rewarm(self.cfg, loaded.path, self.optimizer.steps, saved_config=loaded.config,
                            save_dir=self.cfg.checkpoint.save if loaded.tier == "local" else None)
        # a state restored from the local tier only is saved to the shared tier at the end all the same
        self.loaded_iteration = loaded.iteration if loaded.tier == "shared" else None
        self.iteration = loaded.iteration
        self.wandb_run_id = loaded.run_id or self.wandb_run_id
        # the data position: samples consumed so far (a changed global batch size continues from there)
        self.consumed_samples = loaded.consumed_samples
        if self.topo.is_logging_rank:
            rng = "yes" if loaded.rng_restored else f"partly: {loaded.rng_notice}" if loaded.rng_notice else "no, layout changed"
            where = (f"from the local tier ({', '.join(f'rank {r}' for r in loaded.from_replica)} from their "
                     f"replicas on a peer node) " if loaded.from_replica else "from the local tier " if loaded.tier == "local" else "")
            print(f" loaded checkpoint {loaded.path} {where}at iteration {loaded.iteration} (optimizer state: "
                  f"{'yes' if loaded.optimizer_loaded else 'no'}, RNG state: {rng}; {loaded.seconds:.2f} s)", flush=True)

    def _shared_latest(self) -> str | None:
        """The iteration directory the shared tier's ``latest`` names, or None."""
        from megand.core.checkpointing.files import iter_dir_name, latest_iteration

        latest = latest_iteration(self.cfg.checkpoint.save)
        return os.path.join(self.cfg.checkpoint.save, iter_dir_name(latest[0])) if latest else None

    def _state_finite(self, what: str) -> bool:
        """Whether the weights and optimizer state are finite (collective); warns that ``what`` is skipped if not."""
        self.ddp.finish_param_sync()  # overlapped parameter all-gathers must land before the copy
        # this rank's slices of the weights (under ZeRO-3 the parameters hold no storage between steps)
        weights = [data for _, _, _, data in self.ddp.param_shards()]
        if all_finite([*weights, *self.optimizer.state_tensors()], self.topo.device):
            return True
        if self.topo.is_logging_rank:
            print(f" WARNING: not saving {what} at iteration {self.iteration}: the weights or optimizer state are "
                  f"not finite", flush=True)
        return False

    def save_local(self) -> bool:
        """Save to the node-local tier (collective); False when nothing was saved. A failed local save is
        reported and never stops the run: the shared tier is the one that lasts."""
        from megand.core.checkpointing import CheckpointWriteError

        self._progress("checkpoint save (local tier)", *self._save_budget())
        if not self._state_finite("a local checkpoint"):
            return False
        extra = {**self.guard_state(), "data": self.data_state()}
        try:
            self.checkpointer.save_local(self.iteration, self.consumed_samples, self.wandb_run_id,
                                         self.cfg.train.global_batch_size, extra_state=extra)
        except CheckpointWriteError as e:
            self.writer.write({"iter": self.iteration, "event": "checkpoint_local_save_failed", "error": str(e)})
            if self.topo.is_logging_rank:
                print(f" WARNING: {e}; training continues", flush=True)
            return False
        return True

    def save_checkpoint(self, final: bool = False) -> bool:
        """Save (collective); False when nothing was saved: non-finite state, or a failed write (reported; see
        :mod:`megand.training.save_failures`, which raises SaveFailureStop when the run must stop).
        ``final``: the run's last save. An asynchronous save's outcome is known at the next save or at
        :meth:`close_checkpointer`."""
        t = self.cfg.train
        self.last_save_attempt = self.iteration
        self._progress("checkpoint save", *self._save_budget())
        self.settle_save()  # the previous asynchronous save, published or failed
        if not self._state_finite("a checkpoint"):
            return False
        extra = {**self.guard_state(), "data": self.data_state()}
        from megand.core.checkpointing import CheckpointWriteError

        try:
            self.checkpointer.save(self.iteration, self.consumed_samples, self.wandb_run_id, t.global_batch_size,
                                   extra_state=extra)
        except CheckpointWriteError as e:
            self.save_failures.failed(self.iteration, e, final)
            return False
        if self.checkpointer.pending_iteration is None:  # synchronous: published
            self._saved(self.iteration, f" (training stalled {self.checkpointer.last_stall_s * 1e3:.0f} ms)")
        elif self.topo.is_logging_rank:
            print(f" saving checkpoint at iteration {self.iteration} to {self.cfg.checkpoint.save} in the background "
                  f"(training stalled {self.checkpointer.last_stall_s * 1e3:.0f} ms)", flush=True)
        return True

    def _saved(self, iteration: int, note: str = "") -> None:
        from megand.core.checkpointing.files import iter_dir_name

        self.save_failures.succeeded()
        self.rollback_path = os.path.join(self.cfg.checkpoint.save, iter_dir_name(iteration))
        if self.topo.is_logging_rank:
            print(f" saved checkpoint at iteration {iteration} to {self.cfg.checkpoint.save}{note}", flush=True)

    def settle_save(self, final: bool = False) -> None:
        """Collective: wait for the asynchronous save still being written, if any, and take its outcome (a
        failure reported as a synchronous save's; ``final``: it was the run's last save)."""
        from megand.core.checkpointing import CheckpointWriteError

        iteration = self.checkpointer.pending_iteration
        if iteration is None:
            return
        try:
            self.checkpointer.wait()
        except CheckpointWriteError as e:
            self.save_failures.failed(iteration, e, final)
            return
        self._saved(iteration)

    def _save_budget(self) -> tuple[float, str]:
        """The hang watchdog's budget for a save phase: a save over ``checkpoint.save_timeout_s`` is a failed
        save the ranks then agree on (a collective), so the watchdog waits that collective's timeout more."""
        return (self.configs.save_timeout_s + self.configs.collective_timeout_s,
                "checkpoint.save_timeout_s + train.collective_timeout_s")

    def _report_save_failure(self, record: dict, line: str, alert: str) -> None:
        self.writer.write(record)
        self.wandb.alert("megand: checkpoint save failed", alert)
        if self.topo.is_logging_rank:
            print(line, flush=True)

    def close_checkpointer(self) -> None:
        """Wait for an asynchronous save to be complete and published (its failure handled as a final save's)."""
        # also the time the collectives of a save abandoned over its budget may take to time out (Checkpointer.close)
        budget, key = self._save_budget()
        self._progress("checkpoint save (the last asynchronous write)", budget + self.configs.checkpoint.timeout_s, key)
        self.settle_save(final=True)
        self.checkpointer.close()

    def close(self) -> None:
        """Let go of what outlives the trainer otherwise: the data-parallel engine's hooks on the model
        (through them the engine and its gradient buffers stay alive as long as the parameters do) and
        the metrics file. A process that builds several trainers closes each before the next."""
        self.ddp.close()
        self.writer.close()

    def limits_reached(self, iteration: int) -> tuple[bool, bool]:
        """``(over_time, over_iters)`` of this rank once ``iteration`` is done."""
        t = self.cfg.train
        minutes = (time.monotonic() - self.started) / 60
        return (t.exit_duration_mins is not None and minutes >= t.exit_duration_mins,
                t.exit_interval is not None and iteration >= t.exit_interval)

    def checkpoint_step(self) -> bool:
        """After each step: save when due, or when a stop signal reached any rank, or a time or iteration
        limit is reached (all ranks agree: the max of their votes, taken with the step's own all-reduce);
        True: stop now."""
        c, t = self.cfg.checkpoint, self.cfg.train
        stop = self.agreed_stop
        if stop is None:  # no step since the votes were last counted (none taken yet): count them now
            stop = self.stop.agreed(limit_reached=any(self.limits_reached(self.iteration)))
        self.agreed_stop = None
        over_iters = self.limits_reached(self.iteration)[1]
        if c.local_dir and self.iteration % c.local_interval == 0:
            self.save_local()
        if c.save and (stop or (c.interval and self.iteration % c.interval == 0)):
            self.save_checkpoint(final=bool(stop) or self.iteration >= t.iters)
        if stop and self.topo.is_logging_rank:
            why = ("stop signal received" if stop == StopOnSignal.SIGNAL else
                   f"iteration limit reached (train.exit_interval={t.exit_interval})" if over_iters else
                   f"time limit reached (train.exit_duration_mins={t.exit_duration_mins})")
            print(f" {why}: stopping at iteration {self.iteration}", flush=True)
        return bool(stop)

    @property
    def wandb(self) -> WandbLogger:
        """The run's wandb logger (a no-op off the logging rank or when disabled), resuming ``wandb_run_id``."""
        if self._wandb is None:
            w = self.cfg.logging.wandb
            self._wandb = WandbLogger({**OmegaConf.to_container(w), "name": w.name or self.cfg.name}, self.cfg.run_dir,
                                      OmegaConf.to_container(self.cfg, resolve=True), resume_id=self.wandb_run_id,
                                      enabled_on_this_rank=self.topo.is_logging_rank and w.enabled)
        return self._wandb

    def _count_loss_tokens(self, microbatches, tokens: int | None = None):
        """``tokens``: of the whole batch (default: the training step's)."""
        if self.has_loss:
            self.loss_tokens = loss_token_count(microbatches, self.topo, tokens or self.tokens_per_batch)
            if self.model_cfg.mtp_layers:
                s = self.cfg.model.seq_length
                self.mtp_tokens = mtp_token_counts(microbatches, self.topo, self.model_cfg.mtp_layers,
                                                   (tokens or self.tokens_per_batch) // s, s, self.topo.device)

    def forward_step(self, model, microbatch, hidden):
        documents = (None if microbatch.document_ids is None
                     else DocumentMask(microbatch.document_ids, host_ids=microbatch.host_document_ids))
        out = model(input_ids=microbatch.input_ids if model.reads_tokens else None, positions=microbatch.positions,

                    labels=microbatch.labels if model.post_process else None, hidden=hidden, documents=documents)
        if model.post_process:  # per-token loss -> this micro-batch's share of the global mean
            out, mtp = out if isinstance(out, tuple) else (out, None)
            loss = self._token_mean(out, microbatch)
            if mtp is not None:  # trained on, logged apart: the returned value stays the main loss
                mtp = self._token_sums(mtp, microbatch).div(self.mtp_tokens).mean()  # each depth's mean, averaged
                self.mtp_loss_sum += mtp.detach()
                loss = loss + self.model_cfg.mtp_loss_weight * (mtp - mtp.detach())
            return self.optimizer.scale_loss(loss) if model.training else loss  # fp16: scaled for backward
        return out

    def _token_mean(self, per_token, microbatch):
        """This micro-batch's share of the mean over the global batch's loss tokens of ``per_token [b, s]``."""
        return self._token_sums(per_token, microbatch) / self.loss_tokens

    @staticmethod
    def _token_sums(per_token, microbatch):
        """The sum of ``per_token [..., b, s]`` over the loss tokens of the micro-batch (its last two dims)."""
        per_token = per_token.float()
        if microbatch.loss_mask is not None:
            per_token = per_token * microbatch.loss_mask
        return per_token.sum(dim=(-2, -1))

    def global_loss(self, local_loss_sum):
        """The mean loss over every token of the global batch, a device tensor (meaningful on the last
        stage; None elsewhere). Nothing is read to the host."""
        if local_loss_sum is None:
            return None
        if self.topo.dp_cp_size > 1:
            dist.all_reduce(local_loss_sum, group=self.topo.dp_cp_group)
        return local_loss_sum

    def agreed_step_values(self, loss, grad_stats, stop_vote: int = 0) -> tuple[float, float, bool, int]:
        """Collective over all ranks, and the step's one read of device values: ``(loss, grad_norm,
        found_inf, stop)``, identical on every rank, so every rank takes the same guard decisions.

        ``loss``: :meth:`global_loss` (known on the last stage, None elsewhere); NaN when not finite on
        any rank. ``grad_stats``: the optimizer's all-reduced ``[sum of squares, non-finite count]``.
        ``stop_vote``: this rank's :meth:`StopOnSignal.flag`; ``stop`` is the largest over the ranks (the
        stop decision rides on this all-reduce instead of a world-wide one of its own)."""
        if loss is None:  # a stage without the loss: neutral under MAX
            loss_bad, loss_value = 0.0, -math.inf
        else:
            loss = loss.double()
            finite = torch.isfinite(loss)
            loss_bad = (~finite).double()
            loss_value = torch.where(finite, loss, torch.full_like(loss, -math.inf))
        sum_sq = grad_stats[0]
        grad_bad = ((grad_stats[1] > 0) | ~torch.isfinite(sum_sq)).double()
        agreed = reduce_metrics([  # one MAX all-reduce, and the one device-to-host sync of the step
            Metric("loss_bad", loss_bad, MAX), Metric("loss", loss_value, MAX), Metric("grad_bad", grad_bad, MAX),
            Metric("grad_norm", sum_sq.sqrt(), MAX), Metric("stop", stop_vote, MAX)], self.topo.device,
            self.topo.world_size)
        loss = float("nan") if agreed["loss_bad"] else agreed["loss"]
        return loss, agreed["grad_norm"], bool(agreed["grad_bad"]), int(agreed["stop"])

    def _progress(self, phase: str, timeout_s: float | None = None, key: str = "checkpoint.save_timeout_s") -> None:
        """Report progress to the hang watchdog; ``timeout_s``: a phase of file I/O (a checkpoint save or
        load, budget ``checkpoint.save_timeout_s``, the config key(s) ``key``), where the process's own writes
        count as progress (see megand/training/watchdog.py)."""
        if self.watchdog is not None:
            self.watchdog.progress(self.iteration + 1, phase, timeout_s, key)

    def fp8_weights(self):
        """The FP8 layers' weights quantised once for the step's micro-batches (the optimizer steps after
        it), unless ZeRO-3 frees each gathered weight: an FP8 copy kept for the step would undo it."""
        if self.configs.fp8 is None or self.configs.data_parallel.sharding == "optim_grads_params":
            return contextlib.nullcontext()
        return weights_cached(self.chunks)

    def lockstep(self, microbatches):
        """Around a schedule over this replica's ``microbatches``: under uneven batch shares, the data-parallel
        engine then joins the shard groups' per-micro-batch collectives of the micro-batches this replica
        lacks (megand/core/distributed/data_parallel.py)."""
        return self.ddp.lockstep(len(microbatches), lockstep_microbatches(self.topo.dp_microbatches, len(microbatches)))

    def train_step(self):
        """Forward/backward and the update on the next global batch: ``(loss, StepResult, spike)``. The update
        is skipped on every rank together when the loss or the gradient is not finite, or on a spike that
        will be rolled back."""
        t = self.cfg.train
        self._progress("data")
        if self.ramp.batch_size(self.consumed_samples) != self.batch_size:
            self._plan_batches(self.ramp.batch_size(self.consumed_samples))
        # after a rollback, consumed_samples is past the spike's batch: its data is skipped
        microbatches = self.train_feed.get(self.consumed_samples)
        self._count_loss_tokens(microbatches)
        for chunk in self.chunks:
            chunk.train()
        self.optimizer.zero_grad()
        loss_scale = self.optimizer.loss_scale
        moe.start_step(self.chunks, loss_scale, step_microbatches(self.topo.dp_microbatches, len(microbatches)))
        dsa.start_step(self.chunks, loss_scale, step_microbatches(self.topo.dp_microbatches, len(microbatches)))
        # multi-token prediction: this rank's share of the step's MTP loss (a device tensor, read when logged)
        self.mtp_loss_sum = torch.zeros((), dtype=torch.float32, device=self.topo.device)
        self._progress("forward-backward (pipeline schedule)")
        self.busy.start()  # the device's own time on CUDA (megand/core/timing.py), read when logged
        with self.fp8_weights(), self.lockstep(microbatches):
            loss_sum = self.schedule(self.chunks, microbatches, self.forward_step, self.topo, grad_sync=self.ddp)
        self.busy.stop()  # before the waits for other ranks' gradients
        self._progress("gradient reduction")
        self.ddp.finish_grad_sync()
        self._progress("loss agreement")
        grad_stats = self.optimizer.prepare_grads()  # unscaled (fp16), all-reduced on device; nothing read
        vote = self.stop.flag(limit_reached=any(self.limits_reached(self.iteration + 1)))
        loss, grad_norm, found_inf, self.agreed_stop = self.agreed_step_values(
            self.global_loss(None if loss_sum is None else loss_sum / loss_scale), grad_stats, vote)
        spike = self.spikes.is_spike(loss)
        self._progress("optimizer step")
        result = self.optimizer_step(loss, grad_norm, found_inf, skip=spike and self.can_roll_back())
        if not result.skipped and not spike:
            self.spikes.accept(loss)
        if t.batch_checksum:
            self._progress("batch checksum")
            self.last_batch_checksum = self.batch_checksum(microbatches)
        return loss, result, spike

    def next_lr(self) -> float:
        """The learning rate of the next update. Under a batch-size ramp-up the schedule counts samples in
        units of the final global batch (as Megatron does): its position after this step is the samples
        of the applied updates, this one included, over ``train.global_batch_size``."""
        opt = self.optimizer
        if self.cfg.train.rampup_batch_size is None:
            return opt.schedule(opt.steps + 1)
        return opt.schedule((opt.samples + self.batch_size) / self.cfg.train.global_batch_size)

    def optimizer_step(self, loss: float, grad_norm: float, found_inf: bool, skip: bool) -> StepResult:
        """The update from the agreed values (no further read of device values); skipped on every rank
        together when the loss or the gradient is not finite, or when ``skip`` (a spike to roll back)."""
        opt = self.optimizer
        lr = self.next_lr()
        if not math.isfinite(loss) or skip:
            if not math.isfinite(loss):
                opt.scaler.update(True)  # fp16: back off as for an overflow
            return StepResult(float("nan"), True, lr, opt.loss_scale)
        opt.scaler.update(found_inf)
        if found_inf:
            return StepResult(grad_norm, True, lr, opt.loss_scale)
        opt.update(grad_norm, lr)
        opt.samples += self.batch_size
        moe.update_expert_bias(self.chunks)
        return StepResult(grad_norm, False, lr, opt.loss_scale)

    def step(self):
        """One optimizer step on the next global batch: ``(loss, StepResult)``; the iteration advances and
        skipped steps are counted (``self.skips.exhausted`` after too many in a row)."""
        loss, result, spike = self.train_step()
        self.consumed_samples += self.batch_size
        if self.compile_timer is not None and not self.compile_timer.reported and self.topo.is_logging_rank:
            self.compile_timer.reported = True
            print(f" train.compile: transformer layers compiled in {self.compile_timer.seconds:.1f} s (their first "
                  f"forward calls on this rank; backward graphs compile during the first backward)", flush=True)
        self.iteration += 1
        self.last_spike, self.last_loss = spike, loss
        self.guard_skips(loss, result)
        return loss, result

    def guard_skips(self, loss, result) -> None:
        fp16_backing_off = self.optimizer.loss_scale > getattr(self.optimizer.scaler, "min_scale", math.inf)
        # an fp16 overflow is routine while the loss scale can still back off; a non-finite loss never is
        counts = result.skipped and not self.last_spike and (not math.isfinite(loss) or not fp16_backing_off)

        def where():
            name = first_nonfinite_grad(self.optimizer)
            found = [None] * self.topo.world_size
            dist.all_gather_object(found, name)
            rank = next((r for r, n in enumerate(found) if n), None)
            reason = "non-finite loss" if not math.isfinite(loss) else f"non-finite grad norm ({result.grad_norm})"
            return reason, rank, found[rank] if rank is not None else None

        self.skips.record(self.iteration, result.skipped, counts, where)

    def can_roll_back(self) -> bool:
        """A rollback is allowed and there is a checkpoint of this run to go back to (same on every rank)."""
        t = self.cfg.train
        return t.spike_rollback and self.rollbacks < t.max_rollbacks and self.rollback_path is not None

    def roll_back(self, spike_iteration: int) -> None:
        """Reload the checkpoint this run came from or saved last (never another run's newer one), with the
        spike window as it was there, and skip the data from it up to and including the spike's batch."""
        t = self.cfg.train
        self._progress("spike rollback: loading the last checkpoint", self.configs.save_timeout_s)
        self.settle_save()  # an asynchronous save must be published before it is the one to go back to
        position = self.consumed_samples  # after the spike's batch
        rollbacks = self.rollbacks + 1
        loaded = self.checkpointer.load(self.rollback_path)
        self.load_guard_state(loaded.extra_state)
        self.rollbacks = rollbacks  # counted from this run's own count, carried into the next saves
        skipped = (position - loaded.consumed_samples)
        self.iteration = loaded.iteration
        self.consumed_samples = position
        record = {"iter": spike_iteration, "rollback_to": loaded.iteration,
                  "skipped_samples": [loaded.consumed_samples, position], "rollbacks": self.rollbacks}
        self.writer.write(record)
        if self.topo.is_logging_rank:
            print(f" loss spike at iteration {spike_iteration}: rolled back to iteration {loaded.iteration} "
                  f"({loaded.path}) and skipped samples [{loaded.consumed_samples}, {position}) "
                  f"({skipped} samples; rollback {self.rollbacks} of train.max_rollbacks={t.max_rollbacks})", flush=True)

    def batch_checksum(self, microbatches) -> torch.Tensor:
        """A checksum of the global batch's tokens, equal for every layout that sees the same data: a
        device tensor (``train.batch_checksum``; read at the next log line)."""
        total = torch.zeros(1, dtype=torch.int64, device=self.topo.device)
        for mb in microbatches:
            if mb.input_ids is not None:  # a middle pipeline stage holds no tokens
                total += ((mb.input_ids + 1) * (mb.positions + 1)).sum()
        if self.topo.dp_cp_size > 1:
            dist.all_reduce(total, group=self.topo.dp_cp_group)
        return total

    @torch.no_grad()
    def evaluate(self) -> float:
        t = self.cfg.train
        for chunk in self.chunks:
            chunk.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.topo.device)
        self.valid_feed.restart()  # the same batches at every evaluation: from the start
        for k in range(t.eval_iters):
            self._progress(f"evaluation batch {k + 1}/{t.eval_iters}")
            microbatches = self.valid_feed.get(k * t.global_batch_size, read_ahead=k + 1 < t.eval_iters)
            self._count_loss_tokens(microbatches, t.global_batch_size * self.cfg.model.seq_length)
            with self.fp8_weights(), self.lockstep(microbatches):
                loss_sum = self.schedule(self.chunks, microbatches, self.forward_step, self.topo, forward_only=True)
            loss = self.global_loss(loss_sum)
            total += float("nan") if loss is None else loss.double()
        return total.item() / max(1, t.eval_iters)  # one read per evaluation

    def step_metrics(self) -> list[Metric]:
        """This rank's named values of the last step for the log line, each with its rule over the ranks:
        peak memory and resident state (the most loaded rank's), busy time (forward/backward, outside the
        waits for other ranks' gradients: every rank's, for the straggler report), and the model's own."""
        metrics = [Metric("mem_peak_bytes", peak_memory_bytes(self.topo.device), MAX, integer=True),
                   Metric("state_bytes", self.optimizer.state_bytes(), MAX, integer=True),
                   Metric("busy_s", self.busy.seconds, RANKS)]
        if self.model_cfg.mtp_layers:  # the step's MTP loss: summed over one rank per data shard of the last stage
            counted = self.has_loss and self.topo.tp_rank == 0
            metrics.append(Metric("mtp_loss", self.mtp_loss_sum if counted else 0.0))
        return (metrics + moe.step_metrics(self.chunks, self.model_cfg, self.topo.device)
                + dsa.step_metrics(self.chunks, self.model_cfg, self.topo))

    def log(self, loss, result, iter_time):
        t = self.cfg.train
        if self.iteration % t.log_interval and self.iteration != t.iters and not self.last_spike:
            return
        self._progress("logging")
        # one collective (an all-gather: the busy time is every rank's) and the log line's one read
        values = reduce_metrics(self.step_metrics(), self.topo.device, self.topo.world_size)
        self.busy.reset()
        busy = values.pop("busy_s")
        slowest = max(range(len(busy)), key=busy.__getitem__)
        median = statistics.median(busy)
        slowest_ratio = busy[slowest] / median if median > 0 else 1.0
        flops_per_s = self.flops["model_flops"] / iter_time / self.topo.world_size  # per rank
        record = {
            "iter": self.iteration, "loss": loss, "grad_norm": result.grad_norm, "lr": result.lr,
            "loss_scale": result.loss_scale, "skipped": int(result.skipped),
            "tokens_per_s": self.tokens_per_batch / iter_time, "tflops_per_s": flops_per_s / 1e12,
            "hardware_tflops_per_s": self.flops["hardware_flops"] / iter_time / self.topo.world_size / 1e12,
            "mfu": mfu(flops_per_s, self.peak_flops), "iter_time_ms": iter_time * 1e3,
            "consumed_samples": self.consumed_samples,
            "global_batch_size": self.batch_size, "batch_checksum": (None if self.last_batch_checksum is None
                                                                     else int(self.last_batch_checksum.item())),
            "slowest_rank": slowest, "slowest_ratio": slowest_ratio, "spike": bool(self.last_spike),
            "skipped_total": self.skips.total, **values,  # step_metrics(): memory, state and the model's own
        }
        self.writer.write(record)
        self.wandb.log(record, step=self.iteration)
        if self.topo.is_logging_rank:
            print(console_line(record, t.iters), flush=True)
            if slowest_ratio > t.straggler_ratio:
                print(f" WARNING: straggler: rank {slowest} was busy {slowest_ratio:.2f}x the median rank "
                      f"(train.straggler_ratio={t.straggler_ratio}) over the last {t.log_interval} steps", flush=True)
            if self.last_spike:
                print(f" WARNING: loss spike at iteration {self.iteration}: {loss:.4E} > train.spike_factor="
                      f"{t.spike_factor} x median {self.spikes.median():.4E}", flush=True)

    def run(self):
        from megand.training.watchdog import HangWatchdog

        start, best_val = time.perf_counter(), float("inf")
        if self.topo.is_logging_rank:
            print(f" attention: {self.attention_summary()}", flush=True)
        self.watchdog = HangWatchdog(self.configs.collective_timeout_s, self.topo.rank, self._hang_report)
        try:
            best_val = self._loop(start, best_val)
        finally:
            self.watchdog.close()
            self.watchdog = None
            for feed in (self.train_feed, self.valid_feed):
                if feed is not None:
                    feed.close()
        if self.topo.is_logging_rank:
            print(final_summary(self, time.perf_counter() - start, best_val), flush=True)

    def _hang_report(self, message: str, iteration: int, phase: str) -> None:
        """The watchdog's last act on this rank: its report in run_dir/hang/; rank 0 also the summary."""
        from megand.training import hang_report

        out = hang_report.write_rank_report(self.cfg.run_dir, self.topo.rank, self.topo.world_size, iteration,
                                            phase, message)
        if self.topo.rank == 0:
            # the other ranks' watchdogs fire within about one check period of this one (or never: stopped)
            lines = hang_report.write_summary(out, self.topo.world_size, wait_s=min(20.0, self.configs.collective_timeout_s))
            print("\n".join(f"megand: hang report: {line}" for line in lines), file=sys.stderr, flush=True)

    def iterate(self) -> bool:
        """One iteration of the run's loop, everything a run does per step: the step, its log line (when
        due), evaluation, checkpoint and the stop decision (when due). True: the run stops here. (What
        ``tools/benchmark.py`` times.)"""
        t = self.cfg.train
        step_start = time.perf_counter()
        loss, result = self.step()
        self.log(loss, result, time.perf_counter() - step_start)
        self.run_steps += 1  # this process's steps and samples, for the summary (a resume counts its own)
        self.run_samples += self.batch_size
        if self.skips.exhausted:  # every rank alike; nothing is saved from this state
            raise NonFiniteStop(self.skips.message())
        if self.last_spike and self.can_roll_back():
            self.roll_back(self.iteration)
            return False
        if (t.eval_interval and self.iteration % t.eval_interval == 0) or self.iteration == t.iters:
            self._progress("evaluation")
            if t.eval_iters > 0:
                val_loss = self.evaluate()
                self.best_val = min(self.best_val, val_loss)
                self.writer.write({"iter": self.iteration, "val_loss": val_loss})
                self.wandb.log({"val_loss": val_loss}, step=self.iteration)
                if self.topo.is_logging_rank:
                    print(f" validation at iteration {self.iteration} | lm loss {val_loss:.4E} |", flush=True)
        return self.checkpoint_step()

    def attention_summary(self) -> str:
        """Which kernel runs the layers' attention on this run's device, precision and shapes."""
        m, tp, documents = self.model_cfg, self.topo.tp_size, self.configs.documents
        return attention_summary(self.topo.device, m.params_dtype, m.head_dim, m.num_attention_heads // tp,
                                 max(m.query_groups // tp, 1), self.topo.cp_size, m.cp_comm,
                                 documents is not None and documents.reset_attention_mask)

    def _loop(self, start, best_val):
        t = self.cfg.train
        self.best_val = best_val
        while self.iteration < t.iters:
            if self.iterate():
                break
        best_val = self.best_val
        if self.cfg.checkpoint.save and self.iteration not in (self.checkpointer.last_saved, self.last_save_attempt,
                                                               self.loaded_iteration):
            self.save_checkpoint(final=True)
        if self.checkpointer is not None:
            self.close_checkpointer()
        self.stop.restore()
        self.ddp.finish_param_sync()
        self.writer.close()
        self.wandb.finish()
        return best_val


def final_summary(trainer, seconds: float, best_val: float) -> str:
    """The run's last two lines: one for people, one JSON line for scripts. Steps, tokens and time are this
    run's own (after a resume: the steps since the checkpoint, not the iterations the checkpoint had done)."""
    tokens = trainer.run_samples * trainer.cfg.model.seq_length
    save = trainer.cfg.checkpoint.save
    best = f"{best_val:.4f}" if best_val != float("inf") else "n/a (no evaluation)"
    resumed = (f" (resumed at iteration {trainer.resumed_from}, now at {trainer.iteration})"
               if trainer.resumed_from else "")
    human = (f" training done: {trainer.run_steps} iterations{resumed}, {tokens:,} tokens in {seconds:,.1f} s "
             f"({tokens / max(seconds, 1e-9):,.0f} tokens/s) | best val loss {best} | "
             f"checkpoints: {os.path.abspath(save) if save else 'none (checkpoint.save is null)'} | "
             f"logs: {os.path.abspath(trainer.cfg.run_dir)}")
    machine = json.dumps({"summary": {"iterations": trainer.run_steps, "final_iteration": trainer.iteration,
                                      "tokens": tokens, "seconds": round(seconds, 2),
                                      "best_val_loss": best_val if best_val != float("inf") else None,
                                      "checkpoint_dir": save, "run_dir": trainer.cfg.run_dir,
                                      "wandb_run_id": trainer.wandb_run_id}})
    return human + "\n" + machine


# The errors every rank raises alike, on which the run ends with its own exit code (the entry script's)
ENDS_EVERY_RANK = (*USER_ERRORS, SaveFailureStop, NonFiniteStop)


def pretrain(cfg, adopt_model=None) -> None:
    """Train as ``cfg`` says (``adopt_model``: :class:`Trainer`'s)."""
    try:
        trainer = Trainer(cfg, adopt_model=adopt_model)
        trainer.run()
        dist.barrier()
    except ENDS_EVERY_RANK:
        # raised on every rank alike: tear the process groups down now, not during interpreter exit, where
        # a gloo group's threads may be destroyed still running (abort: "terminate called without an
        # active exception", after the one-line message)
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    dist.destroy_process_group()
