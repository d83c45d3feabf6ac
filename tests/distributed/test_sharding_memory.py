"""Resident state per rank at each sharding level (bf16, dp=4): the bytes per parameter of the sharding table
(bf16, shard size d: none 18, optim 6 + 12/d, optim_grads 2 + 16/d, optim_grads_params 18/d),
measured on the engine's and optimizer's own tensors (what ``state_bytes`` in metrics.jsonl reports)."""

import pytest

from megand.tools.spawn import run_distributed
from tests.distributed.dp_helpers import build_trainer, step

D = 4
EXPECTED = {  # bytes per parameter per rank at shard size D: bf16 param 2, fp32 grad 4, fp32 main 4, Adam m+v 8
    "none": 18,
    "optim": 6 + 12 / D,
    "optim_grads": 2 + 16 / D,
    "optim_grads_params": 18 / D,
}


def _worker():
    out = {}
    for level in EXPECTED:
        t = build_trainer(["train.precision=bf16", f"optim.sharding={level}", "optim.bucket_size=4000"])
        step(t)  # the step boundary: ZeRO-3 has freed every gathered bucket
        n = sum(p.numel() for p in t.params)
        out[level] = (t.optimizer.state_bytes() / n, getattr(t.ddp, "max_gathered", 0),
                      max(b.numel for b in t.ddp.buckets), n)
    return out


def _traffic_worker():
    out = {}
    for case in ("reshard", "keep", "recompute"):  # one micro-batch per rank per step (global batch 8 = 4 ranks x 2)
        t = build_trainer(["train.precision=bf16", "optim.sharding=optim_grads_params", "optim.bucket_size=4000",
                           f"optim.reshard_after_forward={str(case != 'keep').lower()}",
                           f"train.recompute={'full' if case == 'recompute' else 'none'}"])
        step(t)
        before = dict(t.ddp.traffic)
        step(t)
        out[case] = ({k: t.ddp.traffic[k] - before[k] for k in before}, sum(p.numel() for p in t.params))
    return out


def test_state_bytes_per_param_at_each_level_dp4():
    for rank, out in enumerate(run_distributed(_worker, D)):
        for level, expected in EXPECTED.items():
            measured = out[level][0]
            assert abs(measured - expected) <= 0.1 * expected, (rank, level, measured, expected)
        # ZeRO-3 keeps gathered buckets only around their use: far below the full replica
        _, gathered, biggest, n = out["optim_grads_params"]
        assert 0 < gathered * biggest < n / 2, (rank, gathered, biggest, n)


@pytest.mark.slow
def test_zero3_traffic_per_step_against_theory_dp4():
    """ZeRO-3 all-gathers the bf16 parameters in forward and again in backward (once when kept after
    forward) and reduce-scatters the fp32 gradients once: ring volume (d-1)/d of each (bucket padding aside).
    Full recompute re-runs each layer's forward inside backward: that reuses the backward's gather."""
    ring = (D - 1) / D
    for rank, out in enumerate(run_distributed(_traffic_worker, D)):
        for case, gathers in (("reshard", 2), ("keep", 1), ("recompute", 2)):
            traffic, n = out[case]
            assert abs(traffic["all_gather"] / (gathers * ring * 2 * n) - 1) <= 0.05, (rank, case, traffic, n)
            assert abs(traffic["reduce_scatter"] / (ring * 4 * n) - 1) <= 0.05, (rank, case, traffic, n)
            assert traffic["all_reduce"] == 0
