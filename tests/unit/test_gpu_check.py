"""The GPU readiness check's CPU-runnable parts on tiny sizes: one JSON report, a table, every check's
status; the CUDA-only checks report themselves skipped on a machine without CUDA, saying why."""

import functools
import json
import os
import subprocess

import pytest
import torch

from tests.unit.test_trainer_wandb import one_process_world  # noqa: F401  (fixture)


def test_gpu_check_tiny_report(one_process_world, capsys):  # noqa: F811
    from megand.tools.gpu_check import main

    out = one_process_world / "report.json"
    rehearsed = one_process_world / "rehearsed.json"  # as --rehearse-first writes it (rehearse --json per check)
    rehearsed.write_text(json.dumps({"throughput_gpt2_125m": {
        "device": "cuda (h200, 139 GiB usable)",
        "phases": {"build": {"peak_bytes": 1000}, "forward_backward": {"peak_bytes": 4000}}}}))
    results = main(["--sizes", "tiny", "--out", str(out), "--rehearsal", str(rehearsed), "--only",
                    "throughput_gpt2_125m", "cp_block_kernel",
                    "fused_adamw", "memory_stats", "async_checkpoint", "wgrad_fusion", "grouped_gemm",
                    "flex_documents", "sdpa_backend", "nccl_parity", "fp8"])
    report = json.loads(out.read_text())
    status = {r["name"]: r["status"] for r in report["checks"]}
    assert status == {r["name"]: r["status"] for r in results}
    expect_cuda = "ok" if torch.cuda.is_available() else "skipped"
    expect_node = "ok" if torch.cuda.device_count() >= 2 else "skipped"
    assert status == {"throughput_gpt2_125m": "ok", "cp_block_kernel": "ok", "fused_adamw": expect_cuda,
                      "memory_stats": expect_cuda, "async_checkpoint": "ok", "wgrad_fusion": expect_cuda,
                      "grouped_gemm": expect_cuda, "flex_documents": expect_cuda, "sdpa_backend": expect_cuda,
                      "nccl_parity": expect_node, "fp8": "ok"}, report
    for r in report["checks"]:  # every skip says why
        assert r["status"] != "skipped" or ("needs" in r["error"] and r["needs"]), r
    throughput = report["checks"][0]["figures"]
    assert throughput["tokens_per_s"] > 0 and throughput["transformers"]["tokens_per_s"] > 0
    assert throughput["first_loss_rel_diff"] >= 0
    assert throughput["rehearsed_peak_bytes"] == 4000 and throughput["rehearsed_phase"] == "forward_backward"
    assert throughput["peak_ratio"] == throughput["mem_peak_bytes"] / 4000
    assert all(r["budget_s"] > 0 and r["over_budget"] is False for r in report["checks"])  # budgets: one H200's
    cp = report["checks"][1]["figures"]
    for dtype in ("float32", "bfloat16"):
        assert all(cp[dtype][name]["rel_err"] <= max(4 * cp[dtype]["sdpa_rel_err"], 1e-4)
                   for name in ("ring", "all_gather", "a2a")), cp
    assert cp["bfloat16"]["fused_blocks"] == torch.cuda.is_available()
    fp8 = next(r["figures"] for r in report["checks"] if r["name"] == "fp8")
    assert fp8["fp8_tensorwise"]["loss_first"] != fp8["bf16"]["loss_first"]  # FP8 changes the arithmetic...
    assert abs(fp8["fp8_tensorwise"]["loss_first"] - fp8["bf16"]["loss_first"]) < 0.02 * fp8["bf16"]["loss_first"]
    printed = capsys.readouterr().out
    assert "throughput_gpt2_125m" in printed and "async_checkpoint" in printed and str(out) in printed
    assert "needs CUDA" in printed or torch.cuda.is_available()


def test_gpu_check_lists_every_check(capsys):
    from megand.tools.gpu_check import CHECKS, main

    assert main(["--list"]) == []
    printed = capsys.readouterr().out
    assert all(name in printed for name in CHECKS)
    for name in ("grouped_gemm", "flex_documents", "sdpa_backend", "fused_adamw", "wgrad_fusion", "memory_stats"):
        assert f"{name:<22} needs CUDA" in printed
    assert "nccl_parity            needs 2+ CUDA devices" in printed


def test_checks_fit_their_time_on_one_gpu(capsys):
    """The default checks' budgets add up to 5 minutes on one GPU (the NCCL runs need 2+), the first run's
    to about 10; --list names each budget."""
    from megand.tools.gpu_check import BUDGET_S, CHECKS, PRESETS, main

    one_gpu = [c for c in PRESETS["check"] if c != "nccl_parity"]
    assert sum(BUDGET_S[c] for c in one_gpu) <= 300
    assert sum(BUDGET_S[c] for c in PRESETS["first"] if c != "nccl_parity") <= 540
    assert set(PRESETS["first"]) == set(CHECKS) and "compile_speedup" not in PRESETS["check"]
    main(["--list"])
    printed = capsys.readouterr().out
    assert "budget   45 s" in printed and "compile_speedup" in printed and "(--preset first)" in printed


def test_children_keep_the_callers_import_path(monkeypatch, tmp_path):
    """The test-suite and torchrun children get the repository first on PYTHONPATH and keep the caller's
    entries (before: replaced by the repository alone, so packages found through the caller's path were
    lost in the children)."""
    from megand.tools import gpu_check

    seen = []

    def run(cmd, **kwargs):
        seen.append(kwargs["env"]["PYTHONPATH"])
        (tmp_path / "metrics.jsonl").write_text('{"iter": 1, "loss": 2.5}\n')
        return subprocess.CompletedProcess(cmd, 0, stdout="3 passed\n", stderr="")

    monkeypatch.setattr(gpu_check.subprocess, "run", run)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere/site-packages")
    assert gpu_check.check_tests(gpu_check.parse_args([])) == {"summary": "3 passed"}
    assert gpu_check._torchrun_losses(2, [], str(tmp_path), 10) == [2.5]
    assert seen == [os.pathsep.join([gpu_check.ROOT, "/elsewhere/site-packages"])] * 2


def test_the_cuda_test_subset_exists():
    from megand.tools.gpu_check import CUDA_BUILD_TESTS, CUDA_TESTS, ROOT

    assert all(os.path.isfile(os.path.join(ROOT, "tests", "unit", name)) for name in CUDA_TESTS + CUDA_BUILD_TESTS)


def test_attention_kernel_is_read_from_what_ran():
    """The backend reported is the operator the profiler saw, whatever torch's order of preference says."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megand.tools.kernel_probes import attention_seen

    q = torch.randn(1, 2, 16, 8, requires_grad=True)

    def math():
        with sdpa_kernel([SDPBackend.MATH]):
            F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()

    seen = attention_seen(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True), torch.device("cpu"))
    assert seen["backend"] == "flash (cpu)" and seen["ops"] == {"aten::_scaled_dot_product_flash_attention_for_cpu": 1}
    assert attention_seen(math, torch.device("cpu"))["backend"] == "math"
    assert attention_seen(lambda: q @ q.transpose(-1, -2), torch.device("cpu"))["backend"] is None


def test_a_recompiled_function_is_counted():
    from megand.tools.kernel_probes import compiled_entries

    def scale(x, n):
        return x * n

    compiled = torch.compile(scale, backend="eager")
    compiled(torch.ones(2), 1)
    compiled(torch.ones(2), 1)
    assert compiled_entries(scale) == 1
    compiled(torch.ones(2), 2)  # an int argument is specialised: a second version
    assert compiled_entries(scale.__code__) == 2


def test_compile_check_fails_when_a_layer_function_recompiles(one_process_world, monkeypatch):  # noqa: F811
    """Dynamo only (the eager backend: seconds): the check counts each compiled layer function's versions
    and fails exactly when one was compiled more than once."""
    from megand.tools.gpu_check import parse_args, run_check

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    result = run_check("compile", parse_args(["--sizes", "tiny"]))
    versions = result["figures"]["compiled_versions"]
    assert versions and all(n >= 1 for n in versions.values()), result
    recompiled = any(n > 1 for n in versions.values())
    assert result["status"] == ("failed" if recompiled else "ok"), result
    assert not recompiled or "recompiled" in result["error"]


def test_offline_install_uses_the_machines_torch_and_the_wheelhouse(tmp_path):
    """``make gpu-install`` on a Python that has torch: a venv that sees it, megand from ``wheelhouse/`` with no
    index, nothing installing torch; ``make wheelhouse``: every dependency but torch, antlr4 built from source."""
    import shutil
    import sys
    import tomllib

    from megand.tools.gpu_check import ROOT

    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    (tmp_path / "wheelhouse").mkdir()
    (tmp_path / "wheelhouse" / "hydra_core-1.3.8-py3-none-any.whl").write_text("")

    def dry_run(*args):
        return subprocess.run(["make", "-n", *args], cwd=tmp_path, capture_output=True, text=True, check=True).stdout

    install = dry_run("gpu-install", f"PYTHON={sys.executable}")
    assert "-m venv --system-site-packages .venv-gpu" in install and "megand_base_python.pth" in install
    pip = [line for line in install.splitlines() if "pip install" in line]
    assert len(pip) == 1 and "--no-index --find-links wheelhouse -e '.[dev]'" in pip[0] and "torch" not in pip[0]
    wheels = dry_run("wheelhouse")
    assert "pip wheel -q --no-deps -w wheelhouse 'antlr4-python3-runtime==4.9.*'" in wheels
    assert "--only-binary=:all: " in wheels and "--python-version 3.12" in wheels
    project = tomllib.loads((tmp_path / "pyproject.toml").read_text())["project"]
    wanted = [d for d in project["dependencies"] + project["optional-dependencies"]["dev"] if not d.startswith("torch")]
    assert all(f"'{d}'" in wheels for d in wanted) and "'torch" not in wheels
