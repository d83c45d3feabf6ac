"""Device peak FLOP/s: GPU table lookup, CPU measurement cached in the run directory."""

import json

import pytest

from megand.training import peak


@pytest.mark.parametrize("name,precision,tflops", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
    ("NVIDIA H100 PCIe", "bf16", 756.0),
    ("NVIDIA H200", "fp16", 989.4),
    ("NVIDIA H200 NVL", "bf16", 835.5),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
    ("NVIDIA A100-PCIE-40GB", "fp32", 19.5),
    ("NVIDIA L40S", "bf16", 362.1),
    ("NVIDIA GH200 480GB", "bf16", 989.4),
    ("NVIDIA GeForce RTX 4090", "bf16", 165.2),
])
def test_gpu_table(name, precision, tflops):
    assert peak.gpu_peak_flops(name, precision) == pytest.approx(tflops * 1e12)


def test_gpu_table_tf32_and_unknown():
    assert peak.gpu_peak_flops("NVIDIA A100-SXM4-40GB", "fp32", tf32=True) == pytest.approx(156e12)
    assert peak.gpu_peak_flops("NVIDIA A10G", "bf16") is None  # not confused with A100 / A10
    assert peak.gpu_peak_flops("Some Future GPU", "bf16") is None


def test_cpu_peak_is_measured_once_and_reused(tmp_path, monkeypatch):
    calls = []

    def fake_measure(n, repeats):
        calls.append(n)
        return 123.0e9

    monkeypatch.setattr(peak, "measure_matmul_flops", fake_measure)
    first = peak.device_peak_flops("cpu", "fp32", cache_dir=tmp_path)
    second = peak.device_peak_flops("cpu", "bf16", cache_dir=tmp_path)
    assert first == second == 123.0e9
    assert len(calls) == 1
    entry = next(iter(json.loads((tmp_path / peak.CPU_CACHE_NAME).read_text()).values()))
    assert entry["flops_per_s"] == 123.0e9

    # a different thread count is a different machine setting: measured again, both entries kept
    import torch
    threads = torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 1)
    peak.cpu_peak_flops(tmp_path)
    assert len(calls) == 2
    assert len(json.loads((tmp_path / peak.CPU_CACHE_NAME).read_text())) == 2


def test_a_new_run_reads_the_machine_cache_and_keeps_its_own_copy(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(peak, "measure_matmul_flops", lambda n, repeats: calls.append(n) or 7.0e9)
    machine = tmp_path / "machine"
    assert peak.cpu_peak_flops(tmp_path / "run1", shared_dir=machine) == 7.0e9
    assert peak.cpu_peak_flops(tmp_path / "run2", shared_dir=machine) == 7.0e9
    assert len(calls) == 1  # the second run found the machine's figure
    for d in ("run1", "run2", "machine"):
        entry = next(iter(json.loads((tmp_path / d / peak.CPU_CACHE_NAME).read_text()).values()))
        assert entry["flops_per_s"] == 7.0e9 and entry["cpu"] == peak.cpu_model()
    # a run keeps its own figure (its restarts use one denominator) even if the machine's changes
    (machine / peak.CPU_CACHE_NAME).write_text("{}")
    monkeypatch.setattr(peak, "measure_matmul_flops", lambda n, repeats: 9.0e9)
    assert peak.cpu_peak_flops(tmp_path / "run1", shared_dir=machine) == 7.0e9


def test_corrupt_cache_is_remeasured(tmp_path, monkeypatch):
    (tmp_path / peak.CPU_CACHE_NAME).write_text("{not json")
    monkeypatch.setattr(peak, "measure_matmul_flops", lambda n, repeats: 5.0e9)
    assert peak.cpu_peak_flops(tmp_path) == 5.0e9
    assert json.loads((tmp_path / peak.CPU_CACHE_NAME).read_text())


def test_real_measurement_is_positive():
    assert peak.measure_matmul_flops(n=128, repeats=2) > 0


def test_mfu():
    assert peak.mfu(50e12, 100e12) == pytest.approx(0.5)
    assert peak.mfu(50e12, None) is None


def test_measurement_leaves_the_global_rng_alone(tmp_path):
    """Only the logging rank measures, and only when the cache is missing: drawing the matrices from the
    default generator would shift that rank's dropout masks (and make them differ from its tp peers')."""
    import torch

    torch.manual_seed(0)
    before = torch.get_rng_state()
    peak.measure_matmul_flops(n=64, repeats=1)
    peak.device_peak_flops("cpu", "fp32", cache_dir=tmp_path)
    assert torch.equal(torch.get_rng_state(), before), "the peak measurement drew from the default generator"
