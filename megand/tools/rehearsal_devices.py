"""The GPUs a CUDA rehearsal can play (``tools/rehearse.py --device cuda --device-profile NAME``): what
each reports to torch, which kernels its compute capability has, and the memory a rank may use on it.

Memory: ``reported_gib`` is the total torch reports (``get_device_properties().total_memory``; an H200
reports 140.4 GiB of its 141 GB, an H100 79.6 GiB); ``usable_gib`` leaves out what every process holds
before its first tensor (the CUDA context, cuBLAS and NCCL workspaces: :data:`CONTEXT_GIB`). The fit
verdict then keeps a margin (:func:`margin_bytes`) for what a rehearsal does not count (the caching
allocator's fragmentation and rounding, kernels' own workspaces): a rank fits when its rehearsed peak is
at most ``usable - margin``. Within the margin it is not called a fit.

Kernels by compute capability (torch 2.x's CUDA kernels; megand takes the same decisions from
``torch.cuda.get_device_capability``, which the rehearsal answers with the profile's): FP8 products with
one scale per tensor from SM 8.9, per-row scales from 9.0, the FP8 grouped GEMM on 9.0 and 10.x, MX block
scales (``train.fp8=mxfp8``) from 10.0, torch's fused bf16 grouped GEMM on 9.0 and 10.x (elsewhere
``torch._grouped_mm`` runs torch's slower fallback), flash attention from SM 8.0.

The A100 and B200 totals are the published ones (nvidia-smi's MiB as GiB), not measured on this
project's machines.
"""

from __future__ import annotations

import dataclasses

from megand.core.tensor_parallel.fp8 import Fp8Kernels

CONTEXT_GIB = 1.4  # held by a process before its first tensor (an H200: 140.4 GiB reported, ~139 usable)
MARGIN_FRACTION = 0.05  # the fit verdict's margin: 5% of the usable memory...
MARGIN_MIN_GIB = 1.0  # ...and at least 1 GiB


@dataclasses.dataclass(frozen=True)
class RehearsedDevice:
    name: str  # as torch.cuda.get_device_name() reports it
    reported_gib: float  # torch.cuda.get_device_properties().total_memory, GiB
    capability: tuple[int, int]
    sms: int  # streaming multiprocessors

    @property
    def usable_gib(self) -> float:
        return round(self.reported_gib - CONTEXT_GIB, 2)

    @property
    def fp8(self) -> Fp8Kernels:
        return Fp8Kernels.for_capability(self.capability)

    @property
    def fused_grouped_gemm(self) -> bool:
        """Whether torch's fused bf16 grouped GEMM runs (else ``torch._grouped_mm`` is torch's fallback)."""
        return self.capability == (9, 0) or self.capability[0] == 10

    @property
    def sm(self) -> str:
        return f"SM {self.capability[0]}.{self.capability[1]}"


DEVICES = {
    "a100": RehearsedDevice("NVIDIA A100-SXM4-80GB", 79.2, (8, 0), 108),
    "a100-40gb": RehearsedDevice("NVIDIA A100-SXM4-40GB", 39.4, (8, 0), 108),
    "h100": RehearsedDevice("NVIDIA H100 80GB HBM3", 79.6, (9, 0), 132),
    "h200": RehearsedDevice("NVIDIA H200", 140.4, (9, 0), 132),
    "b200": RehearsedDevice("NVIDIA B200", 179.1, (10, 0), 148),
}
DEFAULT = "h100"  # the 80 GB class the GPU presets are sized for


def margin_bytes(usable_bytes: int) -> int:
    return int(max(MARGIN_FRACTION * usable_bytes, MARGIN_MIN_GIB * 2**30))


def fit_verdict(phases: dict, usable_bytes: int) -> dict:
    """The largest phase peak of ``phases`` (``{name: {"peak_bytes": ...}}``) against the usable memory
    less the margin: ``fits``, ``within_margin`` (above usable - margin but not above usable)."""
    name, phase = max(phases.items(), key=lambda kv: kv[1]["peak_bytes"])
    peak, margin = phase["peak_bytes"], margin_bytes(usable_bytes)
    return {"fits": peak <= usable_bytes - margin, "within_margin": usable_bytes - margin < peak <= usable_bytes,
            "phase": name, "peak_bytes": peak, "device_memory_bytes": usable_bytes, "margin_bytes": margin}
