"""Benchmark: short megand / baseline / both runs print one JSON line with every key."""

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
MEGAND_KEYS = KEYS | {"world_size", "layout", "global_batch", "model"}
TINY = ["model=llama_tiny", "model.num_layers=1", "model.ffn_hidden_size=96", "model.vocab_size=256"]
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def tiny_model(**changes) -> dict:
    """The conf/model/llama_tiny preset as a plain dict, with ``changes``."""
    from omegaconf import OmegaConf

    from megand.training.config import compose
    return {**OmegaConf.to_container(compose(["model=llama_tiny"]).model), **changes}


def _load_tool():
    path = Path(__file__).resolve().parents[2] / "tools" / "benchmark.py"
    spec = importlib.util.spec_from_file_location("benchmark_tool", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_baseline_short_run_prints_one_json_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(peak, "measure_matmul_flops", lambda n, repeats: 50e9)  # keep the test short
    _load_tool().main(TINY + ["--mode", "baseline", "--steps", "3", "--warmup", "1", "train.micro_batch_size=2",
                              "--peak-cache-dir", str(tmp_path), f"run_dir={tmp_path}"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert KEYS <= set(result)
    assert result["mode"] == "baseline" and result["precision"] == "fp32" and result["steps"] == 3
    assert result["tokens_per_s"] > 0 and result["mem_peak_bytes"] > 0
    assert result["mfu"] == pytest.approx(result["tflops_per_s"] * 1e12 / 50e9)
    assert (tmp_path / peak.CPU_CACHE_NAME).exists()


def test_bf16_autocast_runs_on_cpu(monkeypatch):
    from megand.tools.benchmark_baseline import run_baseline
    monkeypatch.setattr(peak, "measure_matmul_flops", lambda n, repeats: 50e9)
    cfg = tiny_model(num_layers=1, hidden_size=32, ffn_hidden_size=48, num_attention_heads=2, num_query_groups=1,
                     seq_length=16, vocab_size=128)
    result = run_baseline(cfg, micro_batch=1, steps=1, warmup=0, device="cpu", dtype="bf16")
    assert result["precision"] == "bf16" and result["step_time_iqr_s"] == 0


def test_missing_transformers_is_a_clear_error(monkeypatch):
    from megand.tools.benchmark_baseline import run_baseline
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(RuntimeError, match="transformers"):
        run_baseline(tiny_model(), micro_batch=1, steps=1, warmup=0)


def test_megand_and_baseline_in_one_run(tmp_path, monkeypatch, capsys):
    """``--mode both``: the Trainer in a one-process world, then the baseline; one JSON line, every key."""
    monkeypatch.setattr(peak, "measure_matmul_flops", lambda n, repeats: 50e9)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # not the machine's measured peak
    for name in DIST_ENV:  # init_distributed sets these for a one-process world: restore them afterwards
        monkeypatch.delenv(name, raising=False)
    _load_tool().main(TINY + ["--mode", "both", "--steps", "2", "--warmup", "1", "--rounds", "2",
                              "train.micro_batch_size=2", f"run_dir={tmp_path}"])
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert MEGAND_KEYS | {"baseline", "overhead_ratio"} <= set(result), sorted(MEGAND_KEYS - set(result))
    assert KEYS <= set(result["baseline"])
    assert result["mode"] == "both" and result["baseline"]["mode"] == "baseline"
    assert result["world_size"] == 1 and result["global_batch"] == 2 and result["steps"] == 2
    assert result["tokens_per_step"] == result["baseline"]["tokens_per_step"] == 2 * 32
    assert result["params"] == result["baseline"]["params"]  # the same model shape
    assert result["overhead_ratio"] == pytest.approx(result["baseline"]["tokens_per_s"] / result["tokens_per_s"])
    assert result["speed_ratio"] == pytest.approx(1 / result["overhead_ratio"]) and result["rounds"] == 2
    assert result["mfu"] == pytest.approx(result["tflops_per_s"] * 1e12 / 50e9)
    assert result["loss_first"] == pytest.approx(5.545, abs=0.1)  # ln(256): an untrained model
