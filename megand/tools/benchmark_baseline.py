"""Baseline for the benchmark: the same model shape trained by a plain single-process PyTorch loop.

Hugging Face ``LlamaForCausalLM`` (or ``GPT2LMHeadModel`` for arch=gpt) built from the megand model
config keys, AdamW, random tokens; a fixed number of timed steps after warm-up. megand's own mode in
``tools/benchmark.py`` returns the same keys, so the framework's overhead is a ratio of two runs.
"""

import resource
import statistics
import time
from typing import Any, Mapping, Optional, Union

import torch

from megand.models.flops import flops_per_iteration
from megand.training.peak import device_peak_flops, mfu

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def precision_name(dtype: Union[str, torch.dtype]) -> str:
    """``"bf16"`` for ``"bf16"`` or ``torch.bfloat16``, and so on."""
    if isinstance(dtype, torch.dtype):
        for name, value in _DTYPES.items():
            if value == dtype:
                return name
    elif dtype in _DTYPES:
        return dtype
    raise ValueError(f"unsupported dtype {dtype!r}: use fp32, bf16 or fp16")


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so wall-clock time covers the whole step."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict:
    """Peak allocated bytes on an accelerator; on CPU the process's peak RSS (includes the runtime)."""
    if device.type == "cuda":
        return {"mem_peak_bytes": torch.cuda.max_memory_allocated(device), "mem_peak_kind": "allocated"}
    return {"mem_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "mem_peak_kind": "rss"}


def timing_summary(step_times: list, tokens_per_step: int, flops_per_step: float,
                   peak_flops: Optional[float]) -> dict:
    """Throughput and spread from per-step wall times (seconds); shared by every benchmark mode."""
    median = statistics.median(step_times)
    quartiles = statistics.quantiles(step_times, n=4) if len(step_times) > 1 else [median] * 3
    achieved = flops_per_step / median
    return {
        "tokens_per_s": tokens_per_step / median,
        "step_time_median_s": median,
        "step_time_min_s": min(step_times),
        "step_time_max_s": max(step_times),
        "step_time_iqr_s": quartiles[2] - quartiles[0],
        "tflops_per_s": achieved / 1e12,  # model FLOPs (no recompute) per second, this rank
        "peak_tflops_per_s": peak_flops / 1e12 if peak_flops else None,
        "mfu": mfu(achieved, peak_flops),
    }


def run_baseline(model_cfg: Mapping[str, Any], micro_batch: int, steps: int, warmup: int,
                 device: Union[str, torch.device] = "cpu", dtype: Union[str, torch.dtype] = "fp32",
                 seed: int = 0, lr: float = 3e-4, peak_cache_dir: Optional[str] = None,
                 attn_implementation: str = "sdpa") -> dict:
    """Train ``steps`` timed steps (after ``warmup`` untimed ones) of one micro-batch each; return metrics.

    bf16/fp16 use autocast over fp32 weights (mixed precision, as a plain PyTorch user would); fp16 adds
    a gradient scaler.
    """
    from megand.models.hf import build_hf_model  # raises a clear error when transformers is missing

    if steps < 1:
        raise ValueError("steps must be >= 1")
    device = torch.device(device)
    precision = precision_name(dtype)
    torch.manual_seed(seed)
    model = build_hf_model(model_cfg, attn_implementation=attn_implementation).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")

    seq, vocab = int(model_cfg["seq_length"]), int(model_cfg["vocab_size"])
    data_gen = torch.Generator().manual_seed(seed)

    def train_step() -> float:
        tokens = torch.randint(0, vocab, (micro_batch, seq), generator=data_gen).to(device)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=_DTYPES[precision], enabled=precision != "fp32"):
            loss = model(input_ids=tokens, labels=tokens).loss
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss.item()  # .item() also waits for the step on an accelerator

    losses = []
    for _ in range(warmup):
        losses.append(train_step())
    reset_peak_memory(device)
    step_times = []
    for _ in range(steps):
        synchronize(device)
        start = time.perf_counter()
        losses.append(train_step())
        synchronize(device)
        step_times.append(time.perf_counter() - start)

    tokens_per_step = micro_batch * seq
    flops = flops_per_iteration(model_cfg, micro_batch)["model_flops"]
    peak = device_peak_flops(device, precision, cache_dir=peak_cache_dir)
    return {
        "mode": "baseline",
        "device": str(device),
        "precision": precision,
        "threads": torch.get_num_threads(),
        "params": sum(p.numel() for p in model.parameters()),
        "micro_batch": micro_batch,
        "seq_length": seq,
        "steps": steps,
        "warmup": warmup,
        "tokens_per_step": tokens_per_step,
        **timing_summary(step_times, tokens_per_step, flops, peak),
        **peak_memory(device),
        "loss_first": losses[0],
        "loss_last": losses[-1],
    }
