"""megand's own benchmark mode: the real ``Trainer`` built in-process, timed over what a run does per
iteration (``Trainer.iterate``: the step, its log line at the configured ``train.log_interval``, the
checkpoint and stop decision), so host work outside the step counts as it does in a user's run. The
console lines go to ``console.log`` in the run directory (stdout keeps the one JSON line).

A plain ``python`` launch is a world of one; under ``torchrun`` every rank runs this and rank 0 reports.
The keys are those of the baseline (``megand/tools/benchmark_baseline.py``), so ``--mode both`` divides one by
the other. Step times are the max over ranks of each step; peak memory is the max over ranks.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from typing import Optional

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from megand.tools.benchmark_baseline import peak_memory, reset_peak_memory, synchronize, timing_summary
from megand.models.flops import flops_per_iteration
from megand.training.peak import device_peak_flops


_ROUND_LOGS: set = set()  # the metrics.jsonl files the rounds of this process wrote


def default_run_dir() -> str:
    """Identical on the ranks of one torchrun job (its run id; without one, the agent's pid), private to this
    launch otherwise: a run_dir is never shared by two runs (a second one would be refused)."""
    job = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if job == "none":  # torchrun without --rdzv-id (or no torchrun): the local agent (or this process)
        job = f"pid{os.getppid() if 'LOCAL_RANK' in os.environ else os.getpid()}"
    return os.path.join(tempfile.gettempdir(), f"megand-benchmark-{job}")


def benchmark_config(overrides, steps: int, warmup: int, cuda: bool):
    """The training config for the benchmark: the user's overrides, then what the benchmark decides.

    Unless overridden: no evaluation, one micro-batch per data-parallel rank per step (as the baseline),
    bf16 on CUDA, the run's files in a temporary directory.
    """
    from megand.training.config import compose

    overrides = list(overrides)
    given = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    defaults = [f"train.iters={steps + warmup}", "train.eval_iters=0"]
    if "run_dir" not in given:
        defaults.append(f"run_dir={default_run_dir()}")
    if cuda and "train.precision" not in given:
        defaults.append("train.precision=bf16")
    cfg = compose(overrides + defaults)
    if "train.global_batch_size" not in given:
        p = cfg.parallel
        world = int(os.environ.get("WORLD_SIZE", 1))
        dp = p.dp or max(1, world // (p.tp * p.pp * p.cp))
        cfg.train.global_batch_size = cfg.train.micro_batch_size * dp
    return cfg


def run_megand(cfg, steps: int, warmup: int, peak_cache_dir: Optional[str] = None) -> Optional[dict]:
    """Build ``Trainer(cfg)``, run ``warmup`` then ``steps`` timed iterations (:meth:`Trainer.iterate`);
    return the metrics on rank 0 (None elsewhere). The process group stays up (the caller may run the
    baseline next)."""
    from megand.training.pretrain import Trainer

    if steps < 1:
        raise ValueError("steps must be >= 1")
    os.makedirs(cfg.run_dir, exist_ok=True)
    metrics = os.path.join(cfg.run_dir, "metrics.jsonl")
    if os.path.abspath(metrics) in _ROUND_LOGS and os.path.exists(metrics):
        # a later round of this benchmark: its logs replace the previous round's (a run_dir holding another
        # run's logs is otherwise refused); logs this process did not write are never removed
        if not dist.is_initialized() or dist.get_rank() == 0:
            os.remove(metrics)
        if dist.is_initialized():  # every rank checks the run_dir after rank 0 removed the file
            dist.barrier()
    _ROUND_LOGS.add(os.path.abspath(metrics))
    trainer = Trainer(cfg)
    topo, device = trainer.topo, trainer.topo.device
    losses = []
    with open(os.path.join(cfg.run_dir, "console.log"), "w") as console, contextlib.redirect_stdout(console):
        for _ in range(warmup):
            trainer.iterate()
            losses.append(trainer.last_loss)
        reset_peak_memory(device)
        step_times = []
        for _ in range(steps):
            synchronize(device)
            start = time.perf_counter()
            trainer.iterate()
            losses.append(trainer.last_loss)
            synchronize(device)
            step_times.append(time.perf_counter() - start)

    # the slowest rank sets the step time; the most loaded rank the memory
    times = torch.tensor(step_times, dtype=torch.float64, device=device)
    memory = peak_memory(device)
    mem = torch.tensor([float(memory["mem_peak_bytes"])], dtype=torch.float64, device=device)
    losses_t = torch.tensor([losses[0], losses[-1]], dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    # the loss is known on the last pipeline stage (nan elsewhere): take it from the logging rank
    logging_rank = torch.tensor([topo.rank if topo.is_logging_rank else -1], device=device)
    dist.all_reduce(logging_rank, op=dist.ReduceOp.MAX)
    dist.broadcast(losses_t, src=int(logging_rank.item()))
    trainer.close()
    if topo.rank != 0:
        return None

    t = cfg.train
    tokens_per_step = t.global_batch_size * cfg.model.seq_length
    flops = flops_per_iteration(cfg.model, t.global_batch_size, t.recompute, tp=topo.tp_size,  # padded logits
                                recomputed_layers=trainer.configs.pipeline.recompute_ids)
    flops_per_rank = flops["model_flops"] / topo.world_size
    peak = device_peak_flops(device, t.precision, cache_dir=peak_cache_dir or cfg.run_dir)
    return {
        "mode": "megand",
        "device": str(device),
        "precision": t.precision,
        "threads": torch.get_num_threads(),
        "world_size": topo.world_size,
        "layout": {"tp": topo.tp_size, "pp": topo.pp_size, "cp": topo.cp_size, "dp": topo.dp_size,
                   "sequence_parallel": bool(cfg.parallel.sequence_parallel), "recompute": t.recompute,
                   "distributed_optimizer": cfg.optim.sharding != "none", "sharding": cfg.optim.sharding},
        "params": sum(p.numel() for _, p in trainer.named_params),  # this rank's
        "micro_batch": t.micro_batch_size,
        "global_batch": t.global_batch_size,
        "seq_length": cfg.model.seq_length,
        "steps": steps,
        "warmup": warmup,
        "tokens_per_step": tokens_per_step,
        **timing_summary(times.tolist(), tokens_per_step, flops_per_rank, peak),
        "mem_peak_bytes": int(mem.item()),
        "mem_peak_kind": memory["mem_peak_kind"],
        "loss_first": losses_t[0].item(),
        "loss_last": losses_t[1].item(),
        "model": OmegaConf.to_container(cfg.model, resolve=True),
    }
