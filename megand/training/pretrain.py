"""The training run: config -> topology -> model -> schedule -> optimizer -> logs, as named steps."""

from __future__ import annotations

import json
import os
import resource
import time

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from megand.core.checkpointing import StopOnSignal
from megand.core.distributed import DataParallel
from megand.core.optimizer import Optimizer
from megand.core.parallel_state import ParallelSizes, Topology, init_distributed
from megand.core.pipeline_parallel import get_schedule
from megand.core.pipeline_parallel.layout import chunk_specs, pipeline_layout
from megand.core.sharding import init_parameters
from megand.core.tensor_parallel import seed_random_streams
from megand.core.transformer import TransformerConfig
from megand.core.transformer.documents import DocumentMask
from megand.data.builder import build_datasets as build_data_splits
from megand.models.flops import flops_per_iteration
from megand.models.gpt import GPTModel
from megand.training.agreement import USER_ERRORS, on_every_rank, raise_agreed
from megand.training.batches import loss_token_count, rank_microbatches
from megand.training.config import (
    checkpoint_config,
    data_parallel_config,
    document_flags,
    optimizer_config,
    transformer_config,
    validate,
)
from megand.training.metrics import MetricsWriter, console_line
from megand.training.output_dirs import check_output_dirs
from megand.training.peak import device_peak_flops, mfu
from megand.training.wandb_logger import WandbLogger


def build_topology(cfg, device) -> Topology:
    p = cfg.parallel
    sizes = ParallelSizes.infer(dist.get_world_size(), tp=p.tp, pp=p.pp, cp=p.cp, dp=p.dp)
    return Topology(sizes, order=p.order, vpp=p.vpp, device=device)


def build_model(cfg, topo) -> tuple[TransformerConfig, list[GPTModel]]:
    """This rank's model chunks (one unless interleaved), initialised independently of the layout, and
    its random streams (the default generator and the chunks' shared tensor-parallel stream) seeded."""
    model_cfg = transformer_config(cfg)
    rng = seed_random_streams(cfg.train.seed, topo)
    layers = pipeline_layout(model_cfg.num_layers, topo.pp_size, cfg.parallel.vpp, cfg.parallel.pipeline_layout)
    chunks = []
    for spec in chunk_specs(layers, topo.pp_size, topo.pp_rank):
        chunk = GPTModel(model_cfg, topo, rng, spec.layer_ids, spec.pre_process, spec.post_process)
        init_parameters(chunk, cfg.train.seed)
        chunks.append(chunk)
    return model_cfg, chunks


def build_datasets(cfg, topo):
    """Train and validation datasets. Index files are cached in ``data.cache_dir``: global rank 0 builds
    them first; then the first rank of every other node (which loads rank 0's files when the filesystem
    is shared, or builds its own on a node-local disk); then every other rank, which loads its node's.
    Writes are atomic (private name, then rename), so even a concurrent build cannot be read half-done.
    A bad input found in any phase stops every rank at the end of that phase, with the same message."""
    t, m = cfg.train, cfg.model
    num_samples = (t.iters * t.global_batch_size, t.eval_iters * t.global_batch_size, 0)
    turn = 0 if topo.rank == 0 else 1 if topo.local_rank == 0 else 2
    for phase in range(3):
        error = None
        if phase == turn:
            try:
                train, valid, _ = build_data_splits(cfg.data, m.seq_length, m.vocab_size, t.seed, num_samples)
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

    def __init__(self, cfg, wandb_run_id: str | None = None):
        self.cfg = cfg
        device = init_distributed()
        # before any work: the values, then the directories the run must be able to write
        on_every_rank(lambda: validate(cfg, dist.get_world_size()))
        on_every_rank(lambda: check_output_dirs(cfg))
        self.topo = build_topology(cfg, device)
        # data before the model: a bad dataset fails before any model memory is spent (numpy RNGs of its
        # own: the order changes no random stream)
        self.train_data, self.valid_data = build_datasets(cfg, self.topo)
        self.model_cfg, self.chunks = build_model(cfg, self.topo)
        self.named_params = [(n, p) for chunk in self.chunks for n, p in chunk.named_parameters()]
        self.params = [p for _, p in self.named_params]
        self.ddp = DataParallel(self.chunks, self.topo, data_parallel_config(cfg))  # params now live in its buffers
        self.optimizer = Optimizer(self.named_params, optimizer_config(cfg), self.topo, self.ddp)
        self.schedule = get_schedule(self.topo)
        self._plan_batches()
        self.iteration, self.sample_offset = 0, 0
        self.wandb_run_id = wandb_run_id or new_wandb_run_id()  # a loaded checkpoint's id replaces it
        self._wandb = None  # started on first use, after a checkpoint may have set wandb_run_id
        self.checkpointer = self._build_checkpointer()
        self.stop = StopOnSignal()
        if cfg.checkpoint.load:
            self.load_checkpoint(cfg.checkpoint.load)
        self._open_logs()

    def _plan_batches(self):
        """What each step reads and computes: tokens per global batch, FLOPs, whether this rank reads tokens."""
        cfg = self.cfg
        self.tokens_per_batch = cfg.train.global_batch_size * cfg.model.seq_length
        # stages with neither the embedding nor the loss read no tokens
        needs_tokens = any(chunk.pre_process or chunk.post_process for chunk in self.chunks)
        self.has_loss = any(chunk.post_process for chunk in self.chunks)
        self.batch_needs = dict(seq_length=cfg.model.seq_length, needs_tokens=needs_tokens,
                                documents=document_flags(cfg))
        self.loss_tokens = self.tokens_per_batch  # per global batch: fewer with data.eod_mask_loss
        self.flops = flops_per_iteration(cfg.model, cfg.train.global_batch_size, cfg.train.recompute)

    def _build_checkpointer(self):
        cfg = self.cfg
        if not (cfg.checkpoint.save or cfg.checkpoint.load):
            return None
        from megand.core.checkpointing import Checkpointer

        return Checkpointer(checkpoint_config(cfg), self.topo, self.named_params, self.optimizer, self.chunks,
                            OmegaConf.to_yaml(cfg, resolve=True), OmegaConf.to_container(cfg.model, resolve=True))

    def _open_logs(self):
        """metrics.jsonl (appended to after a resume), the MFU denominator and the run's config file."""
        cfg, logging_rank = self.cfg, self.topo.is_logging_rank
        self.writer = MetricsWriter(cfg.run_dir, logging_rank, append=self.iteration > 0)
        self.peak_flops = device_peak_flops(self.topo.device, cfg.train.precision, cfg.run_dir) if logging_rank else None
        if logging_rank:
            with open(os.path.join(cfg.run_dir, "config.yaml"), "w") as f:
                f.write(OmegaConf.to_yaml(cfg, resolve=True))

    def load_checkpoint(self, path):
        loaded = self.checkpointer.load(path)
        self.iteration = loaded.iteration
        self.wandb_run_id = loaded.run_id or self.wandb_run_id
        # the data position: samples consumed so far (a changed global batch size continues from there)
        self.sample_offset = loaded.consumed_samples - loaded.iteration * self.cfg.train.global_batch_size
        if self.topo.is_logging_rank:
            print(f" loaded checkpoint {loaded.path} at iteration {loaded.iteration} (optimizer state: "
                  f"{'yes' if loaded.optimizer_loaded else 'no'}, RNG state: "
                  f"{'yes' if loaded.rng_restored else 'no, layout changed'})", flush=True)

    def save_checkpoint(self):
        t = self.cfg.train
        self.ddp.finish_param_sync()  # overlapped parameter all-gathers must land before the copy
        self.checkpointer.save(self.iteration, self.sample_offset + self.iteration * t.global_batch_size,
                               self.wandb_run_id, t.global_batch_size)
        if self.topo.is_logging_rank:
            print(f" saved checkpoint at iteration {self.iteration} to {self.cfg.checkpoint.save} "
                  f"(training stalled {self.checkpointer.last_stall_s * 1e3:.0f} ms)", flush=True)

    def checkpoint_step(self) -> bool:
        """After each step: save when due or when a stop signal reached any rank; True: stop now."""
        c = self.cfg.checkpoint
        stop = self.stop.agreed()
        if c.save and (stop or (c.interval and self.iteration % c.interval == 0)):
            self.save_checkpoint()
        if stop and self.topo.is_logging_rank:
            print(f" stop signal received: stopping at iteration {self.iteration}", flush=True)
        return stop

    @property
    def wandb(self) -> WandbLogger:
        """The run's wandb logger (a no-op off the logging rank or when disabled), resuming ``wandb_run_id``."""
        if self._wandb is None:
            w = self.cfg.logging.wandb
            self._wandb = WandbLogger({**OmegaConf.to_container(w), "name": w.name or self.cfg.name}, self.cfg.run_dir,
                                      OmegaConf.to_container(self.cfg, resolve=True), resume_id=self.wandb_run_id,
                                      enabled_on_this_rank=self.topo.is_logging_rank and w.enabled)
        return self._wandb

    def _count_loss_tokens(self, microbatches):
        if self.has_loss:
            self.loss_tokens = loss_token_count(microbatches, self.topo, self.tokens_per_batch)

    def forward_step(self, model, microbatch, hidden):
        documents = None if microbatch.document_ids is None else DocumentMask(microbatch.document_ids)
        out = model(input_ids=microbatch.input_ids if model.pre_process else None, positions=microbatch.positions,
                    labels=microbatch.labels if model.post_process else None, hidden=hidden, documents=documents)
        if model.post_process:  # per-token loss -> this micro-batch's share of the global mean
            out = out.float() if microbatch.loss_mask is None else out.float() * microbatch.loss_mask
            loss = out.sum() / self.loss_tokens
            return self.optimizer.scale_loss(loss) if model.training else loss  # fp16: scaled for backward
        return out

    def global_loss(self, local_loss_sum):
        """The mean loss over every token of the global batch (meaningful on the last stage)."""
        if local_loss_sum is None:
            return float("nan")
        if self.topo.dp_cp_size > 1:
            dist.all_reduce(local_loss_sum, group=self.topo.dp_cp_group)
        return local_loss_sum.item()

    def train_step(self):
        t = self.cfg.train
        microbatches = rank_microbatches(self.train_data, self.iteration, t.global_batch_size, t.micro_batch_size,
                                         self.topo, offset=self.sample_offset, **self.batch_needs)
        self._count_loss_tokens(microbatches)
        for chunk in self.chunks:
            chunk.train()
        self.optimizer.zero_grad()
        loss_scale = self.optimizer.loss_scale
        loss_sum = self.schedule(self.chunks, microbatches, self.forward_step, self.topo, grad_sync=self.ddp)
        self.ddp.finish_grad_sync()
        result = self.optimizer.step()
        self.last_batch_checksum = self.batch_checksum(microbatches)
        return self.global_loss(None if loss_sum is None else loss_sum / loss_scale), result

    def step(self):
        """One optimizer step on the next global batch: ``(loss, StepResult)``; the iteration advances."""
        loss, result = self.train_step()
        self.iteration += 1
        return loss, result

    def batch_checksum(self, microbatches) -> int:
        """A checksum of the global batch's tokens, equal for every layout that sees the same data."""
        local = sum(int(((mb.input_ids + 1) * (mb.positions + 1)).sum()) for mb in microbatches
                    if mb.input_ids is not None)  # a middle pipeline stage holds no tokens
        total = torch.tensor([local], dtype=torch.int64, device=self.topo.device)
        if self.topo.dp_cp_size > 1:
            dist.all_reduce(total, group=self.topo.dp_cp_group)
        return int(total.item())

    @torch.no_grad()
    def evaluate(self) -> float:
        t = self.cfg.train
        for chunk in self.chunks:
            chunk.eval()
        total = 0.0
        for k in range(t.eval_iters):
            microbatches = rank_microbatches(self.valid_data, k, t.global_batch_size, t.micro_batch_size, self.topo,
                                             **self.batch_needs)
            self._count_loss_tokens(microbatches)
            total += self.global_loss(self.schedule(self.chunks, microbatches, self.forward_step, self.topo, forward_only=True))
        return total / max(1, t.eval_iters)

    def log(self, loss, result, iter_time):
        t = self.cfg.train
        if self.iteration % t.log_interval and self.iteration != t.iters:
            return
        mem_peak = torch.tensor(float(peak_memory_bytes(self.topo.device)), device=self.topo.device)
        dist.all_reduce(mem_peak, op=dist.ReduceOp.MAX)  # the most loaded rank
        flops_per_s = self.flops["model_flops"] / iter_time / self.topo.world_size  # per rank
        record = {
            "iter": self.iteration, "loss": loss, "grad_norm": result.grad_norm, "lr": result.lr,
            "loss_scale": result.loss_scale, "skipped": int(result.skipped),
            "tokens_per_s": self.tokens_per_batch / iter_time, "tflops_per_s": flops_per_s / 1e12,
            "hardware_tflops_per_s": self.flops["hardware_flops"] / iter_time / self.topo.world_size / 1e12,
            "mfu": mfu(flops_per_s, self.peak_flops), "mem_peak_bytes": int(mem_peak.item()),
            "iter_time_ms": iter_time * 1e3, "consumed_samples": self.iteration * t.global_batch_size,
            "global_batch_size": t.global_batch_size, "batch_checksum": self.last_batch_checksum,
        }
        self.writer.write(record)
        self.wandb.log(record, step=self.iteration)
        if self.topo.is_logging_rank:
            print(console_line(record, t.iters), flush=True)

    def run(self):
        t = self.cfg.train
        start, best_val = time.perf_counter(), float("inf")
        while self.iteration < t.iters:
            step_start = time.perf_counter()
            loss, result = self.step()
            self.log(loss, result, time.perf_counter() - step_start)
            if (t.eval_interval and self.iteration % t.eval_interval == 0) or self.iteration == t.iters:
                if t.eval_iters > 0:
                    val_loss = self.evaluate()
                    best_val = min(best_val, val_loss)
                    self.writer.write({"iter": self.iteration, "val_loss": val_loss})
                    self.wandb.log({"val_loss": val_loss}, step=self.iteration)
                    if self.topo.is_logging_rank:
                        print(f" validation at iteration {self.iteration} | lm loss {val_loss:.4E} |", flush=True)
            if self.checkpoint_step():
                break
        if self.cfg.checkpoint.save and self.checkpointer.last_saved != self.iteration:
            self.save_checkpoint()
        if self.checkpointer is not None:
            self.checkpointer.close()  # waits for an asynchronous save to be complete and published
        self.stop.restore()
        self.ddp.finish_param_sync()
        self.writer.close()
        self.wandb.finish()
        if self.topo.is_logging_rank:
            print(final_summary(self, time.perf_counter() - start, best_val), flush=True)


def final_summary(trainer, seconds: float, best_val: float) -> str:
    """The run's last two lines: one for people, one JSON line for scripts."""
    tokens = trainer.iteration * trainer.tokens_per_batch
    save = trainer.cfg.checkpoint.save
    best = f"{best_val:.4f}" if best_val != float("inf") else "n/a (no evaluation)"
    human = (f" training done: {trainer.iteration} iterations, {tokens:,} tokens in {seconds:,.1f} s "
             f"({tokens / max(seconds, 1e-9):,.0f} tokens/s) | best val loss {best} | "
             f"checkpoints: {os.path.abspath(save) if save else 'none (checkpoint.save is null)'} | "
             f"logs: {os.path.abspath(trainer.cfg.run_dir)}")
    machine = json.dumps({"summary": {"iterations": trainer.iteration, "tokens": tokens, "seconds": round(seconds, 2),
                                      "best_val_loss": best_val if best_val != float("inf") else None,
                                      "checkpoint_dir": save, "run_dir": trainer.cfg.run_dir,
                                      "wandb_run_id": trainer.wandb_run_id}})
    return human + "\n" + machine


def pretrain(cfg) -> None:
    trainer = Trainer(cfg)
    trainer.run()
    dist.barrier()
    dist.destroy_process_group()
