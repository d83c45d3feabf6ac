"""Benchmark baseline mode: a short run prints one JSON line with every key."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from megand.training import peak

KEYS = {"mode", "device", "precision", "threads", "params", "micro_batch", "seq_length", "steps", "warmup",
        "tokens_per_step", "tokens_per_s", "step_time_median_s", "step_time_min_s", "step_time_max_s",
        "step_time_iqr_s", "tflops_per_s", "peak_tflops_per_s", "mfu", "mem_peak_bytes", "mem_peak_kind",
        "loss_first", "loss_last"}
TINY = ["--preset", "llama_50m", "--num-layers", "1", "--hidden-size", "64", "--ffn-hidden-size", "96",
        "--num-attention-heads", "4", "--num-query-groups", "2", "--seq-length", "32", "--vocab-size", "256"]


def _load_tool():
    path = Path(__file__).resolve().parents[2] / "tools" / "benchmark.py"
    spec = importlib.util.spec_from_file_location("benchmark_tool", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_baseline_short_run_prints_one_json_line(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    monkeypatch.setattr(peak, "measure_matmul_flops", lambda n, repeats: 50e9)  # keep the test short
    _load_tool().main(TINY + ["--steps", "3", "--warmup", "1", "--micro-batch-size", "2", "--device", "cpu",
                              "--peak-cache-dir", str(tmp_path)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert KEYS <= set(result)
    assert result["mode"] == "baseline" and result["precision"] == "fp32" and result["steps"] == 3
    assert result["tokens_per_s"] > 0 and result["mem_peak_bytes"] > 0
    assert result["mfu"] == pytest.approx(result["tflops_per_s"] * 1e12 / 50e9)
    assert (tmp_path / peak.CPU_CACHE_NAME).exists()


def test_bf16_autocast_runs_on_cpu(monkeypatch):
    pytest.importorskip("transformers")
    from megand.benchmark_baseline import run_baseline
    from megand.model_args import PRESETS
    monkeypatch.setattr(peak, "measure_matmul_flops", lambda n, repeats: 50e9)
    cfg = {**PRESETS["llama_50m"], "num_layers": 1, "hidden_size": 32, "ffn_hidden_size": 48,
           "num_attention_heads": 2, "num_query_groups": 1, "seq_length": 16, "vocab_size": 128}
    result = run_baseline(cfg, micro_batch=1, steps=1, warmup=0, device="cpu", dtype="bf16")
    assert result["precision"] == "bf16" and result["step_time_iqr_s"] == 0


def test_missing_transformers_is_a_clear_error(monkeypatch):
    from megand.benchmark_baseline import run_baseline
    from megand.model_args import PRESETS
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(RuntimeError, match="transformers"):
        run_baseline(PRESETS["llama_50m"], micro_batch=1, steps=1, warmup=0)
