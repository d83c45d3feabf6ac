"""The GPU readiness check's CPU-runnable parts on tiny sizes: one JSON report, a table, every check's
status; the CUDA-only checks report themselves skipped on a machine without CUDA, saying why."""

import json

import torch

from tests.unit.test_trainer_wandb import one_process_world  # noqa: F401  (fixture)


def test_gpu_check_tiny_report(one_process_world, capsys):  # noqa: F811
    from megand.tools.gpu_check import main

    out = one_process_world / "report.json"
    results = main(["--sizes", "tiny", "--out", str(out), "--only", "throughput_gpt2_125m", "cp_block_kernel",
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
