"""Device peak FLOP/s (the denominator of MFU).

GPUs: a table of vendor datasheet figures, dense (no structured sparsity), per GPU. bf16/fp16 use the
tensor-core figure; fp32 uses the plain fp32 figure unless torch is allowed to use TF32 for matmuls
(``torch.get_float32_matmul_precision() != "highest"``), in which case the TF32 figure applies.

CPU: no useful datasheet number exists, so the peak is *measured*: the best FLOP/s of a large fp32
``torch.mm`` with the current thread count. It is measured once and cached as JSON in the run
directory (keyed by CPU model, thread count and size), so every restart of a run uses the same
denominator, and in the machine's cache directory (``$XDG_CACHE_HOME/megand``, default
``~/.cache/megand``), so a new run on the same CPU does not spend seconds measuring it again.
"""

import json
import os
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch

TFLOP = 1e12


@dataclass(frozen=True)
class GpuPeak:
    bf16: float  # dense bf16/fp16 tensor-core TFLOP/s
    tf32: float  # dense TF32 tensor-core TFLOP/s
    fp32: float  # non-tensor fp32 TFLOP/s
    fp8: Optional[float] = None  # dense FP8 tensor-core TFLOP/s (None: no FP8 tensor cores)


# (words that must all appear in torch.cuda.get_device_name(), case-insensitive) -> peak.
# Names are split into words on non-alphanumerics ("NVIDIA A100-SXM4-80GB" -> NVIDIA A100 SXM4 80GB),
# so "A10" does not match "A100" nor "L40" match "L40S". The first match wins: variants come first.
GPU_PEAKS: tuple = (
    (("GB200",), GpuPeak(bf16=2500.0, tf32=1250.0, fp32=80.0, fp8=5000.0)),
    (("B200",), GpuPeak(bf16=2250.0, tf32=1100.0, fp32=75.0, fp8=4500.0)),
    (("H200", "NVL"), GpuPeak(bf16=835.5, tf32=417.5, fp32=60.0, fp8=1671.0)),
    (("H200",), GpuPeak(bf16=989.4, tf32=494.7, fp32=66.9, fp8=1978.9)),
    (("GH200",), GpuPeak(bf16=989.4, tf32=494.7, fp32=66.9, fp8=1978.9)),
    (("H100", "PCIE"), GpuPeak(bf16=756.0, tf32=378.0, fp32=51.2, fp8=1513.0)),
    (("H100", "NVL"), GpuPeak(bf16=835.5, tf32=417.5, fp32=60.0, fp8=1671.0)),
    (("H100",), GpuPeak(bf16=989.4, tf32=494.7, fp32=66.9, fp8=1978.9)),  # SXM ("H100 80GB HBM3")
    (("H800",), GpuPeak(bf16=989.4, tf32=494.7, fp32=66.9, fp8=1978.9)),
    (("A100",), GpuPeak(bf16=312.0, tf32=156.0, fp32=19.5)),
    (("A800",), GpuPeak(bf16=312.0, tf32=156.0, fp32=19.5)),
    (("L40S",), GpuPeak(bf16=362.1, tf32=183.0, fp32=91.6, fp8=733.0)),
    (("L40",), GpuPeak(bf16=181.0, tf32=90.5, fp32=90.5)),
    (("L4",), GpuPeak(bf16=121.0, tf32=60.0, fp32=30.3)),
    (("A10",), GpuPeak(bf16=125.0, tf32=62.5, fp32=31.2)),
    (("RTX", "4090"), GpuPeak(bf16=165.2, tf32=82.6, fp32=82.6)),
    (("RTX", "3090"), GpuPeak(bf16=71.0, tf32=35.6, fp32=35.6)),
    (("V100",), GpuPeak(bf16=125.0, tf32=15.7, fp32=15.7)),  # fp16 tensor cores; no bf16/tf32
    (("MI300X",), GpuPeak(bf16=1307.4, tf32=653.7, fp32=163.4, fp8=2614.9)),
    (("MI250X",), GpuPeak(bf16=383.0, tf32=95.7, fp32=95.7)),
)

CPU_CACHE_NAME = "cpu_peak_flops.json"


def gpu_peak_flops(device_name: str, precision: str, tf32: bool = False) -> Optional[float]:
    """Datasheet peak FLOP/s of a GPU by name, or None when the name is not in the table (or, for
    ``precision="fp8"``, when the GPU has no FP8 tensor cores)."""
    words = set(re.split(r"[^0-9A-Z]+", device_name.upper()))
    for keys, peak in GPU_PEAKS:
        if all(k.upper() in words for k in keys):
            if precision == "fp8":
                return peak.fp8 * TFLOP if peak.fp8 else None
            if precision in ("bf16", "fp16"):
                return peak.bf16 * TFLOP
            return (peak.tf32 if tf32 else peak.fp32) * TFLOP
    return None


def measure_matmul_flops(n: int = 2048, repeats: int = 5, dtype: torch.dtype = torch.float32,
                         device: Union[str, torch.device] = "cpu") -> float:
    """Best FLOP/s of an n×n×n ``torch.mm`` over ``repeats`` timed runs (after one warm-up).

    The matrices come from a private generator: only the logging rank measures, and only when no cached
    figure exists, so a draw from the default generator would shift that rank's dropout masks.
    """
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, dtype=dtype, device=device, generator=generator)
    b = torch.randn(n, n, dtype=dtype, device=device, generator=generator)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best


def machine_cache_dir() -> Path:
    """Where measurements of this machine are kept across runs: ``$XDG_CACHE_HOME/megand``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megand"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's processor string elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _read_entries(path: Optional[Path]) -> dict:
    try:
        entries = json.loads(path.read_text()) if path is not None and path.exists() else {}
    except (OSError, ValueError):
        return {}  # unreadable: measured again and rewritten
    return entries if isinstance(entries, dict) else {}


def cpu_peak_flops(cache_dir: Optional[Union[str, Path]] = None, n: int = 2048, repeats: int = 5,
                   shared_dir: Optional[Union[str, Path]] = None) -> float:
    """Measured fp32 matmul FLOP/s of this CPU at the current thread count, cached in ``cache_dir``
    (the run's) and ``shared_dir`` (the machine's, :func:`machine_cache_dir`): read from the first that
    has it, written to both.

    A cache entry is reused only for the same CPU model, thread count and matrix size; other entries in
    a file are kept, so runs with different thread counts (or a home directory shared by nodes of
    different CPUs) can share a directory.
    """
    threads = torch.get_num_threads()
    key = f"cpu={cpu_model()},threads={threads},n={n},dtype=float32"
    paths = [Path(d) / CPU_CACHE_NAME for d in (cache_dir, shared_dir) if d is not None]
    files = [(path, _read_entries(path)) for path in paths]
    found = next((e[key] for _, e in files if isinstance(e.get(key), dict) and "flops_per_s" in e[key]), None)
    try:
        flops = float(found["flops_per_s"]) if found else None
    except (TypeError, ValueError):
        flops = None
    if flops is None:
        flops = measure_matmul_flops(n=n, repeats=repeats)
    entry = {"flops_per_s": flops, "threads": threads, "n": n, "dtype": "float32", "cpu": cpu_model()}
    for path, entries in files:
        if entries.get(key) != entry:
            _write_entries(path, {**entries, key: entry})
    return flops


def _write_entries(path: Path, entries: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # private: two writers never share it
        tmp.write_text(json.dumps(entries, indent=1))
        tmp.replace(path)  # atomic: a concurrent reader sees the old or the new file, never half
    except OSError as e:  # a read-only home directory costs a measurement per run, not the run
        warnings.warn(f"could not cache the CPU peak FLOP/s in {path}: {e}")


def mixed_peak(peak: float, fp8_peak: Optional[float], fp8_fraction: float) -> float:
    """The peak of a step whose FLOPs are ``fp8_fraction`` FP8 GEMMs (at ``fp8_peak``) and the rest at
    ``peak``: the FLOPs over the time each part takes at its own peak. No FP8 peak: ``peak``."""
    if not fp8_fraction or not fp8_peak:
        return peak
    return 1.0 / ((1.0 - fp8_fraction) / peak + fp8_fraction / fp8_peak)


def device_peak_flops(device: Union[str, torch.device], precision: str = "bf16",
                      cache_dir: Optional[Union[str, Path]] = None, fp8_fraction: float = 0.0,
                      shared_dir: Optional[Union[str, Path]] = None) -> Optional[float]:
    """Peak FLOP/s for MFU on ``device``: the table for CUDA GPUs, a cached measurement on CPU
    (:func:`cpu_peak_flops`: ``cache_dir`` the run's, ``shared_dir`` the machine's).
    ``fp8_fraction``: the share of the model FLOPs run as FP8 GEMMs (``train.fp8``), counted at the GPU's
    FP8 peak (:func:`mixed_peak`).

    On CPU the measurement is fp32 whatever ``precision`` is (CPU bf16 matmul speed varies by ISA).
    Returns None, with a warning, for a GPU missing from the table: MFU is then not reported.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return cpu_peak_flops(cache_dir, shared_dir=shared_dir)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tf32 = torch.get_float32_matmul_precision() != "highest"
        peak = gpu_peak_flops(name, precision, tf32=tf32)
        if peak is None:
            warnings.warn(f"unknown GPU {name!r}: no peak FLOP/s, MFU will not be reported")
            return None
        return mixed_peak(peak, gpu_peak_flops(name, "fp8"), fp8_fraction)
    warnings.warn(f"no peak FLOP/s known for device type {device.type!r}")
    return None


def mfu(achieved_flops_per_s: float, peak_flops_per_s: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation as a fraction (0.4 = 40%); None when the peak is unknown."""
    if not peak_flops_per_s:
        return None
    return achieved_flops_per_s / peak_flops_per_s
