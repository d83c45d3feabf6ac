"""The calibration's pieces: fitting math on synthetic timings, the profile it writes, its bad input."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megand.tools.calibrate import build_profile, modelled_compute_s, rank_path
from megand.tools.calibration.fit import (bus_factor, fit_alpha_beta, fit_overheads, nonnegative_lstsq,
                                          predict_overheads)
from megand.tools.calibration.overheads import DESIGN, steady_step_seconds
from tests.harness import ranks_device, ranks_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZES = [1024 * 4 ** i for i in range(8)]


def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bus_factor("all_gather", 4) == bus_factor("reduce_scatter", 4) == bus_factor("all_to_all", 4) == 0.75
    assert bus_factor("p2p", 8) == 1.0
    with pytest.raises(ValueError, match="broadcast"):
        bus_factor("broadcast", 2)


@pytest.mark.parametrize("op,n", [("all_reduce", 2), ("all_gather", 8), ("p2p", 2)])
def test_alpha_beta_recovered_exactly(op, n):
    alpha, gbps = 3e-5, 7.5
    seconds = [alpha + bus_factor(op, n) * b / (gbps * 1e9) for b in SIZES]
    fit = fit_alpha_beta(op, n, SIZES, seconds)
    assert fit["alpha_s"] == pytest.approx(alpha, rel=1e-6)
    assert fit["gbps"] == pytest.approx(gbps, rel=1e-6)


def test_alpha_beta_with_noise_keeps_relative_accuracy():
    """5% multiplicative noise: alpha (set by the small messages) and the bandwidth (by the large ones)
    both within 10%, which a plain least squares on absolute times would not give alpha."""
    rng = np.random.default_rng(0)
    alpha, gbps = 1e-4, 2.0
    seconds = [(alpha + 0.5 * b / (gbps * 1e9)) * (1 + 0.05 * rng.standard_normal()) for b in SIZES]
    fit = fit_alpha_beta("all_gather", 2, SIZES, seconds)
    assert fit["alpha_s"] == pytest.approx(alpha, rel=0.1)
    assert fit["gbps"] == pytest.approx(gbps, rel=0.1)


def test_alpha_beta_never_negative():
    """Times that fall with size (noise at small sizes): alpha clamps to 0, the bandwidth stays positive."""
    seconds = [5e-4, 4e-4, 3e-4, 2.5e-4, 4e-4, 1e-3, 4e-3, 1.6e-2]
    fit = fit_alpha_beta("all_reduce", 2, SIZES, seconds)
    assert fit["alpha_s"] >= 0 and fit["gbps"] > 0


def test_alpha_beta_needs_two_sizes():
    with pytest.raises(ValueError, match="two message sizes"):
        fit_alpha_beta("p2p", 2, [1024, 1024], [1e-5, 1e-5])


def test_nonnegative_lstsq_clamps_a_negative_term():
    x = np.array([[1, 0.0], [1, 1], [1, 2], [1, 3]])
    y = np.array([3.0, 2, 1, 0])  # slope -1: the unconstrained fit is negative
    sol = nonnegative_lstsq(x, y)
    assert sol[1] == 0 and sol[0] == pytest.approx(1.5)


def synthetic_runs(overheads, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    runs = []
    for layers, m in DESIGN:
        modelled = 1e-4 * layers * m
        measured = (modelled + predict_overheads(overheads, layers, m)) * (1 + noise * rng.standard_normal())
        runs.append({"layers": layers, "microbatches": m, "measured_s": measured, "modelled_s": modelled})
    return runs


def test_overheads_recovered_from_synthetic_steps():
    truth = {"per_layer_step": 1.1e-3, "per_microbatch": 2e-4, "per_step": 8e-4}
    fit = fit_overheads(synthetic_runs(truth))
    for key, value in truth.items():
        assert fit[key] == pytest.approx(value, rel=1e-6), key


def test_overheads_with_noise_predict_the_steps():
    truth = {"per_layer_step": 1.0e-3, "per_microbatch": 1e-4, "per_step": 1e-3}
    runs = synthetic_runs(truth, noise=0.03, seed=1)
    fit = fit_overheads(runs)
    assert all(v >= 0 for v in fit.values())
    for r in runs:  # every step predicted within 10%
        predicted = r["modelled_s"] + predict_overheads(fit, r["layers"], r["microbatches"])
        assert predicted == pytest.approx(r["measured_s"], rel=0.1)


def test_overheads_need_three_design_points():
    runs = synthetic_runs({"per_layer_step": 1e-3, "per_microbatch": 0, "per_step": 0})[:2]
    with pytest.raises(ValueError, match="three"):
        fit_overheads(runs)


def test_steady_step_time_leaves_out_the_first_steps(tmp_path):
    path = tmp_path / "metrics.jsonl"
    from megand.tools.calibration.overheads import WARMUP_ITERS

    times = [500, 90, 80, 70, 60][:WARMUP_ITERS] + [60] * (WARMUP_ITERS - 5) + [10, 12, 11, 30]
    rows = [{"iter": i, "loss": 1.0, "iter_time_ms": t} for i, t in enumerate(times, 1)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + [{"iter": len(rows), "val_loss": 1.0}]))
    assert steady_step_seconds(str(path)) == pytest.approx(0.0115)


def rank_figures(scale):
    return {"gemm": [{"m": 32, "n": 64, "k": 64, "tflops": 0.01 * scale}, {"m": 512, "n": 512, "k": 512,
                                                                           "tflops": 0.1 * scale}],
            "bandwidth": [{"op": "add", "numel": 1, "gbps": 10.0 * scale}, {"op": "gelu", "numel": 1, "gbps": 30 * scale}],
            "overheads": {"per_layer_step": 1e-3 * scale, "per_microbatch": 1e-4, "per_step": 1e-3},
            "overhead_runs": []}


def test_profile_in_the_planner_format():
    coll = {link: {op: {"alpha_s": 1e-5, "gbps": 1.0} for op in ("all_reduce", "all_gather", "reduce_scatter", "p2p",
                                                                  "all_to_all")} for link in ("intra_node", "inter_node")}
    profile = build_profile("cpu", "measured", "fp32", [rank_figures(1), rank_figures(2), rank_figures(4)], coll)
    assert set(profile) == {"name", "source", "dtype", "peak_tflops", "gemm", "memory_gbps", "overhead_s", "collectives"}
    assert profile["gemm"][1] == {"m": 512, "n": 512, "k": 512, "tflops": pytest.approx(0.2)}  # median over ranks
    assert profile["peak_tflops"] == pytest.approx(0.2)
    assert profile["memory_gbps"] == pytest.approx(40.0)  # median of each rank's median: 20, 40, 80
    assert profile["overhead_s"] == {"per_layer_step": pytest.approx(2e-3), "per_microbatch": 1e-4, "per_step": 1e-3}
    assert profile["collectives"] == coll
    json.dumps(profile)  # plain JSON


def flat_profile_dict(tflops=0.05, overheads=None):
    coll = {link: {op: {"alpha_s": 1e-5, "gbps": 1.0} for op in ("all_reduce", "all_gather", "reduce_scatter", "p2p",
                                                                  "all_to_all")} for link in ("intra_node", "inter_node")}
    gemm = [{"m": m, "n": n, "k": k, "tflops": tflops} for m in (32, 2048) for n in (32, 2048) for k in (32, 2048)]
    return {"name": "flat", "peak_tflops": tflops, "gemm": gemm, "memory_gbps": 20.0, "collectives": coll,
            "overhead_s": overheads or {}}


def test_fitted_overheads_are_the_ones_the_planner_adds():
    """Steps 'measured' as the planner's prediction with known overheads: the fit, on the planner's
    prediction without them, recovers those overheads (the fit's formula is how the planner applies them)."""
    from megand.tools.calibration.overheads import run_overrides
    from megand.tools.calibration.predict import one_device_group, predict_config
    from megand.tools.planner.profile import Profile
    from megand.training.config import compose

    truth = {"per_layer_step": 7e-4, "per_microbatch": 3e-4, "per_step": 2e-3}
    with_overheads = one_device_group(Profile.from_dict(flat_profile_dict(overheads=truth)))
    bare = flat_profile_dict()
    runs = []
    for layers, m in DESIGN:
        cfg = compose(run_overrides(layers, m))
        modelled = modelled_compute_s(cfg, bare["gemm"], bare["memory_gbps"], bare["collectives"])
        measured = predict_config(cfg, 1, [with_overheads]).step_time_s
        assert modelled > 0 and measured > modelled
        runs.append({"layers": layers, "microbatches": m, "measured_s": measured, "modelled_s": modelled})
    fit = fit_overheads(runs)
    for key, value in truth.items():
        assert fit[key] == pytest.approx(value, rel=1e-6, abs=1e-9), (key, fit)


def test_rank_paths():
    assert rank_path("out/cpu.json", 1) == "out/cpu.rank1.json"
    assert rank_path("cpu", 0) == "cpu.rank0.json"


def calibrate(*args, nproc=1):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", **ranks_env(nproc)}
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "calibrate.py"), *map(str, args)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


@pytest.mark.parametrize("args,named", [
    (["--nproc", "1"], "--nproc 1"),
    (["--gemm-sizes", "32,x"], "32,x"),
    (["--output", "/nonexistent-dir/p.json"], "/nonexistent-dir"),
    (["model.num_layers=0"], "num_layers"),
])
def test_bad_input_is_one_line(tmp_path, args, named):
    if "--output" not in args:
        args = ["--output", tmp_path / "p.json", *args]
    proc = calibrate(*args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0], proc.stderr[-2000:]
    assert not os.listdir(tmp_path)


def test_quick_calibration_writes_a_profile(tmp_path):
    """Two ranks, the smallest grids and no training runs: the command end to end, not its figures."""
    out = tmp_path / "cpu.json"
    proc = calibrate("--nproc", 2, "--quick", "--no-overheads", "--per-rank", "--output", out, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    profile = json.loads(out.read_text())
    # calibrate.py's GEMM dtype: bf16 on CUDA, fp32 on the CPU
    assert profile["dtype"] == ("bf16" if ranks_device(2) == "cuda" else "fp32") and profile["peak_tflops"] > 0 and len(profile["gemm"]) == 8
    assert profile["overhead_s"] == {"per_layer_step": 0.0, "per_microbatch": 0.0, "per_step": 0.0}
    for link in ("intra_node", "inter_node"):
        for fit in profile["collectives"][link].values():
            assert fit["alpha_s"] >= 0 and fit["gbps"] > 0
    assert "inter_node copied from intra_node" in profile["source"]
    for rank in (0, 1):
        assert json.loads((tmp_path / f"cpu.rank{rank}.json").read_text())["collectives"] == profile["collectives"]


def test_overhead_runs_keep_the_rank_on_its_own_gpu(monkeypatch):
    """Without the launcher's LOCAL_RANK a child would use GPU 0: it gets this rank's device only."""
    import torch

    from megand.tools.calibration.overheads import device_env

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert device_env(torch.device("cuda", 3)) == {"CUDA_VISIBLE_DEVICES": "3"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert device_env(torch.device("cuda", 2)) == {"CUDA_VISIBLE_DEVICES": "6"}
    assert device_env(torch.device("cpu")) == {}


def test_timing_counts_the_time_a_shared_device_is_taken_away():
    """A call that is now and then held up (another process's time slice on the same core) is timed as
    its sustained mean, not as the typical uninterrupted call: a hog sharing the core shows."""
    import time

    import torch

    from megand.tools.calibration.measure import time_call

    calls = []

    def sometimes_preempted():
        calls.append(1)
        time.sleep(0.020 if len(calls) % 5 == 0 else 0.001)

    mean = (4 * 0.001 + 0.020) / 5
    assert time_call(sometimes_preempted, torch.device("cpu"), min_time=0.1, windows=2) >= 0.8 * mean
