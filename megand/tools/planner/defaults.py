"""Shipped profiles of common devices (a cluster group names one with ``device:``).

No network was available when these were written: the figures are the well-known published ones,
quoted from memory and rounded, with their sources below; calibrate (``tools/calibrate.py``) on the
real machine for better ones.

- Peaks and memory sizes/bandwidths: NVIDIA datasheets (dense, without sparsity): A100 SXM 80GB
  312 TFLOP/s bf16, 2,039 GB/s HBM2e, NVLink 3 600 GB/s (300 per direction); H100 SXM 989 TFLOP/s bf16,
  3,350 GB/s HBM3, NVLink 4 900 GB/s (450 per direction); H200 SXM 989 TFLOP/s bf16, 141 GB, 4,800 GB/s
  HBM3e. One NIC per GPU in DGX/HGX nodes: 200 Gb/s HDR InfiniBand for A100 (25 GB/s), 400 Gb/s NDR
  for H100/H200 (50 GB/s).
- GEMM efficiency: cuBLAS bf16 matmul throughput as commonly reported (NVIDIA's "Matrix multiplication
  background" deep-learning performance guide; public GEMM sweeps): large square products reach about
  85% of peak on A100 and 75-78% on H100/H200 (power/clock limited), falling steeply below 1-2k; attention
  products with k = head_dim 128 reach about 55-60% (A100) and 45-50% (H100) of peak.
- Effective memory bandwidth: ~85% of the datasheet figure (STREAM-like copy kernels).
- Collectives: nccl-tests bus bandwidth of large messages on DGX A100 (all_reduce ~230 GB/s inside a
  node, ~23 GB/s per GPU across nodes over HDR) and DGX H100 (~370 GB/s inside, ~45 GB/s per GPU across
  over NDR); latencies of a few tens of microseconds.
- The CPU profile is a rough default for this repository's 2-core test machine (an fp32 matmul there runs
  at about 84 GFLOP/s on one thread); calibrate it.
"""

from __future__ import annotations

from megand.tools.planner.profile import OPS, Profile


def _colls(intra_gbps: float, inter_gbps: float, intra_alpha: float, inter_alpha: float,
           p2p_intra: float | None = None) -> dict:
    intra = {op: {"alpha_s": intra_alpha, "gbps": intra_gbps} for op in OPS}
    intra["p2p"] = {"alpha_s": intra_alpha, "gbps": p2p_intra or intra_gbps}
    inter = {op: {"alpha_s": inter_alpha, "gbps": inter_gbps} for op in OPS}
    return {"intra_node": intra, "inter_node": inter}


def _square_curve(effs: dict, head_dim_effs: dict) -> list:
    """Points from efficiencies of square products (size -> eff) and of attention-like products
    (m = n = size, k = 128)."""
    points = [{"m": s, "n": s, "k": s, "eff": e} for s, e in effs.items()]
    points += [{"m": s, "n": s, "k": 128, "eff": e} for s, e in head_dim_effs.items()]
    # skinny products (a small micro-batch's tokens against wide weights) behave like their small side
    points += [{"m": 512, "n": 8192, "k": 8192, "eff": effs[2048]},
               {"m": 256, "n": 8192, "k": 8192, "eff": effs[1024]}]
    return points


def _profile(name, source, dtype, peak, curve, memory_gbps, colls, overhead=None, peak_fp8=None) -> Profile:
    gemm = [{"m": p["m"], "n": p["n"], "k": p["k"], "tflops": p["eff"] * peak} for p in curve]
    d = {"name": name, "source": source, "dtype": dtype, "peak_tflops": peak, "gemm": gemm,
         "memory_gbps": memory_gbps, "collectives": colls, "overhead_s": overhead or {}}
    if peak_fp8 is not None:  # dense FP8 tensor-core peak (datasheet); train.fp8 GEMMs run against it
        d["peak_fp8_tflops"] = peak_fp8
    return Profile.from_dict(d, where=f"shipped profile {name}")


_A100_CURVE = _square_curve({256: 0.10, 512: 0.35, 1024: 0.62, 2048: 0.78, 4096: 0.84, 8192: 0.86, 16384: 0.86},
                            {1024: 0.40, 2048: 0.50, 4096: 0.56, 8192: 0.58})
_H100_CURVE = _square_curve({256: 0.05, 512: 0.18, 1024: 0.40, 2048: 0.62, 4096: 0.72, 8192: 0.77, 16384: 0.77},
                            {1024: 0.30, 2048: 0.40, 4096: 0.46, 8192: 0.50})
_SOURCE = "shipped default (datasheet peak; published cuBLAS and nccl-tests figures, see defaults.py)"


def device(name: str) -> dict:
    """The known device ``name``: peak_tflops, memory_gib, intra/inter_node_gbps and its profile."""
    return DEVICES[name]


DEVICES = {
    "a100": dict(peak_tflops=312.0, memory_gib=80, intra_node_gbps=230.0, inter_node_gbps=23.0,
                 profile=_profile("a100-80gb-sxm", _SOURCE, "bf16", 312.0, _A100_CURVE, 1700.0,
                                  _colls(230.0, 23.0, 2e-5, 3e-5, p2p_intra=200.0))),
    "a100-40gb": dict(peak_tflops=312.0, memory_gib=40, intra_node_gbps=230.0, inter_node_gbps=23.0,
                      profile=_profile("a100-40gb-sxm", _SOURCE, "bf16", 312.0, _A100_CURVE, 1330.0,
                                       _colls(230.0, 23.0, 2e-5, 3e-5, p2p_intra=200.0))),
    "h100": dict(peak_tflops=989.0, memory_gib=80, intra_node_gbps=370.0, inter_node_gbps=45.0,
                 profile=_profile("h100-sxm", _SOURCE, "bf16", 989.0, _H100_CURVE, 2850.0,
                                  _colls(370.0, 45.0, 2e-5, 3e-5, p2p_intra=320.0), peak_fp8=1979.0)),
    "h200": dict(peak_tflops=989.0, memory_gib=141, intra_node_gbps=370.0, inter_node_gbps=45.0,
                 profile=_profile("h200-sxm", _SOURCE, "bf16", 989.0, _H100_CURVE, 4100.0,
                                  _colls(370.0, 45.0, 2e-5, 3e-5, p2p_intra=320.0), peak_fp8=1979.0)),
    "cpu": dict(peak_tflops=0.084, memory_gib=8, intra_node_gbps=2.0, inter_node_gbps=1.0,
                profile=_profile("cpu-1core", "rough default for a one-core CPU rank on gloo (calibrate it)", "fp32",
                                 0.084, [{"m": 64, "n": 64, "k": 64, "eff": 0.25},
                                         {"m": 256, "n": 256, "k": 256, "eff": 0.7},
                                         {"m": 1024, "n": 1024, "k": 1024, "eff": 0.95}],
                                 8.0, _colls(2.0, 1.0, 1e-4, 2e-4),
                                 {"per_layer_step": 1e-3, "per_microbatch": 2e-3, "per_step": 5e-3})),
}
