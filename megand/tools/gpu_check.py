"""One-command GPU readiness check (``make gpu-check``): every check in turn, one JSON report, a table.

    python tools/gpu_check.py [--out gpu_check.json] [--sizes full|tiny] [--only NAME ...]
    python tools/gpu_check.py --preset first --rehearsal gpu_first_rehearsal.json --out gpu_first.json
    python tools/gpu_check.py --rehearse-first gpu_first_rehearsal.json    (on a CPU build, before the GPU)
    python tools/gpu_check.py --list

Every check is listed in the report; on a machine without CUDA (or with fewer GPUs than a check needs)
the CUDA-only ones say ``skipped`` and why. Each check runs with the CUDA memory statistics reset and
records its own peak (``peak_bytes``). Checks (each records ok / failed / skipped, its seconds and its
figures; a failure does not stop the rest):
- ``tests``: the unit tests whose code takes a CUDA path on a GPU (``CUDA_TESTS``: kernels, attention, FP8,
  GEMM seam, timers, RNG state, peak FLOP/s, host syncs; on a CUDA build also the rehearsal's rules), by
  pytest in a subprocess;
- ``throughput_llama_1b`` / ``throughput_gpt2_125m``: bf16 training (CUDA; fp32 on CPU) of ``llama_1b`` at
  seq 4096 and ``gpt2_125m``: tokens/s, TFLOP/s, MFU, peak memory, next to transformers on the same shape
  and batch in this process (``speed_ratio`` = megand / transformers tokens/s); with ``--rehearsal``, the
  peak next to the CUDA rehearsal's of the same configuration (``rehearsed_peak_bytes``, ``peak_ratio``);
- ``fp8``: ``llama_1b`` (as ``throughput_llama_1b``) in bf16 and with ``train.fp8=tensorwise``: tokens/s
  and losses of both, ``fp8_speedup`` (on CPU every FP8 product is emulated: correctness only, no speed);
- ``cp_block_kernel``: context-parallel attention (ring, all-gather, all-to-all; cp=1 in this process)
  against full causal SDPA, forward and input gradients, in fp32 and bf16 (on CUDA the fused flash block
  kernel); and that kernel against the explicit block math;
- ``fused_adamw``, ``memory_stats``, ``async_checkpoint``: a few training steps of a tiny model through each
  path (torch's fused AdamW and CUDA memory statistics need CUDA: skipped without it);
- ``compile``: ``train.compile=true`` steps of a tiny model: compile seconds, graph breaks (dynamo's
  counters), and the compiled versions of each layer function: it fails when one compiled more than once;
- ``compile_speedup`` (CUDA; ``--preset first``): ``llama_1b`` compiled against eager, tokens/s of both;
- ``wgrad_fusion`` (CUDA): bf16 weight-gradient products added into an fp32 accumulator as the parallel
  linear layers do, against their float64 sum (whether this torch's ``addmm`` has ``out_dtype``);
- ``grouped_gemm`` (CUDA): the MoE experts' grouped GEMM (``torch._grouped_mm``) against the loop over
  experts in bf16, forward and gradients;
- ``flex_documents`` (CUDA): document-masked attention (FlexAttention block masks) against the dense
  mask with SDPA, forward and gradients;
- ``sdpa_backend`` (CUDA): the attention kernels that run llama_1b's attention (bf16; fp32 with GQA) through
  the layers' own path and through ``F.scaled_dot_product_attention``, read from the profiler (the aten
  operator and the device kernels launched), forward and backward;
- ``nccl_parity`` (2+ GPUs): tiny LLaMA runs of 3 steps under torchrun with NCCL at 2 ranks (tp+sp,
  pp+vpp, cp, ZeRO-3, ep) and, on a full node of 8, at 8 ranks, against the one-GPU run: step losses
  within 1e-4 relative (fp32; TF32 off).

Time on one H200: each check has a budget (``BUDGET_S``, seconds, first compilations included; a check
over it is marked in the report and the table); the default checks' budgets add up to 5 minutes; ``--preset
first`` adds ``compile_speedup`` and more timed steps, about 10 minutes. A node of 8 adds the NCCL parity
runs, about two minutes. The budgets are estimates from the sizes until a GPU run records the seconds.

``--sizes tiny`` runs the same checks on tiny models (seconds, also on CPU); the unit tests use it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
THROUGHPUT = {  # name: (full-size overrides, tiny overrides)
    "throughput_llama_1b": (["model=llama_1b", "model.seq_length=4096", "train.micro_batch_size=1"],
                            ["+experiment=tiny_llama", "train.micro_batch_size=2"]),
    "throughput_gpt2_125m": (["model=gpt2_125m", "train.micro_batch_size=8"],
                             ["+experiment=tiny_gpt", "train.micro_batch_size=2"]),
}
CHECKS = ("tests", *THROUGHPUT, "fp8", "cp_block_kernel", "fused_adamw", "memory_stats", "async_checkpoint", "compile",
          "compile_speedup", "wgrad_fusion", "grouped_gemm", "flex_documents", "sdpa_backend", "nccl_parity")
PRESETS = {"check": tuple(c for c in CHECKS if c != "compile_speedup"), "first": CHECKS}
NEEDS = {"fused_adamw": "CUDA", "memory_stats": "CUDA", "compile_speedup": "CUDA", "wgrad_fusion": "CUDA",
         "grouped_gemm": "CUDA", "flex_documents": "CUDA", "sdpa_backend": "CUDA", "nccl_parity": "2+ CUDA devices"}
# seconds per check on one H200 at full sizes, first compilations included (the default checks: 300 in all)
BUDGET_S = {"tests": 45, "throughput_llama_1b": 40, "throughput_gpt2_125m": 20, "fp8": 30, "cp_block_kernel": 15,
            "fused_adamw": 8, "memory_stats": 8, "async_checkpoint": 10, "compile": 60, "compile_speedup": 150,
            "wgrad_fusion": 5, "grouped_gemm": 8, "flex_documents": 35, "sdpa_backend": 10, "nccl_parity": 120}
# the unit tests whose code takes a CUDA path when CUDA is available (the rest of tests/unit is the CPU suite's)
CUDA_TESTS = ("test_attention_kernels.py", "test_cp_block_kernels.py", "test_document_attention.py", "test_fp8.py",
              "test_fp8_kernels.py", "test_fp8_grouped.py", "test_gemm_seam.py", "test_wgrad_fusion.py",
              "test_timing.py", "test_checkpoint_rng.py", "test_peak.py", "test_host_syncs.py",
              "test_test_placement.py")
# on a CUDA build only: the rehearsal's rules in this process, its runs skipped in one line (on a CPU build they are
# the CPU suite's: two minutes of rehearsals)
CUDA_BUILD_TESTS = ("test_rehearse_cuda.py",)


class Skipped(Exception):
    """The check cannot run here (e.g. it needs CUDA)."""


class CheckFailed(Exception):
    """The check ran and its figures show a failure (kept in the report)."""

    def __init__(self, message: str, figures: dict):
        super().__init__(message)
        self.figures = figures


def cuda() -> bool:
    return torch.cuda.is_available()


def need_cuda():
    if not cuda():
        raise Skipped("needs CUDA (torch.cuda.is_available() is False here): a CUDA-only path")


@contextlib.contextmanager
def tiny_trainer(overrides):
    """A tiny LLaMA Trainer in this process (a one-process world), writing under a temp directory; closed
    on leaving (its engine and buffers go with it, not with the checks after it)."""
    from megand.training.config import compose
    from megand.training.pretrain import Trainer

    run_dir = tempfile.mkdtemp(prefix="megand_gpu_check_")
    precision = ["train.precision=bf16"] if cuda() else []
    trainer = Trainer(compose(["+experiment=tiny_llama", f"run_dir={run_dir}", "train.eval_iters=0", *precision,
                               *overrides]))
    try:
        yield trainer
    finally:
        trainer.close()


def steps(trainer, n=2) -> list[float]:
    losses = [trainer.step()[0] for _ in range(n)]
    if not all(math.isfinite(x) for x in losses):
        raise RuntimeError(f"non-finite loss: {losses}")
    return losses


def child_env(**extra) -> dict:
    """This process's environment for a child, with the repository first on its import path (the
    caller's ``PYTHONPATH`` kept after it)."""
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def check_tests(args) -> dict:
    names = CUDA_TESTS + (CUDA_BUILD_TESTS if torch.version.cuda else ())
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           *(os.path.join("tests", "unit", name) for name in names)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.tests_timeout, env=child_env())
    summary = (proc.stdout.strip().splitlines() or [""])[-1]
    if proc.returncode != 0:
        raise RuntimeError(f"pytest exit {proc.returncode}: {summary}\n{proc.stdout[-3000:]}")
    return {"summary": summary}


def _sizes(args, name) -> list[str]:
    full, tiny = THROUGHPUT[name]
    return list(full if args.sizes == "full" else tiny)


def _steps(args) -> tuple[int, int]:
    """(timed steps, warm-up steps) of a throughput run."""
    return (args.steps, 2) if args.sizes == "full" else (1, 1)


_RUNS: dict = {}  # megand's throughput runs of this process, by overrides: a later check reuses an earlier run


def megand_run(args, overrides: list[str]) -> tuple:
    """(config, figures) of megand training with ``overrides`` (:func:`run_megand`), once per process."""
    from megand.tools.benchmark_megand import benchmark_config, run_megand

    key = (args.sizes, args.steps, *overrides)
    if key not in _RUNS:
        n, warmup = _steps(args)
        run_dir = tempfile.mkdtemp(prefix="megand_gpu_check_")
        cfg = benchmark_config([*overrides, f"run_dir={run_dir}"], n, warmup, cuda())
        _RUNS[key] = cfg, run_megand(cfg, n, warmup, peak_cache_dir=run_dir)
    return _RUNS[key]


def check_throughput(args, name) -> dict:
    from omegaconf import OmegaConf

    from megand.tools.benchmark_baseline import run_baseline

    n, warmup = _steps(args)
    cfg, mine = megand_run(args, _sizes(args, name))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda() else torch.device("cpu")
    theirs = run_baseline(OmegaConf.to_container(cfg.model, resolve=True), cfg.train.micro_batch_size, n, warmup,
                          device, cfg.train.precision, seed=cfg.train.seed, peak_cache_dir=cfg.run_dir)
    keys = ("tokens_per_s", "tflops_per_s", "mfu", "mem_peak_bytes", "step_time_median_s", "loss_first", "loss_last")
    figures = {"precision": cfg.train.precision, "seq_length": cfg.model.seq_length,
               "micro_batch": cfg.train.micro_batch_size, **{k: mine[k] for k in keys},
               "transformers": {k: theirs[k] for k in keys},
               "speed_ratio": mine["tokens_per_s"] / theirs["tokens_per_s"],
               "first_loss_rel_diff": abs(mine["loss_first"] - theirs["loss_first"]) / abs(theirs["loss_first"])}
    if args.rehearsal and name in args.rehearsal:
        figures.update(rehearsal_figures(args.rehearsal[name], mine["mem_peak_bytes"]))
    return figures


def rehearsal_figures(report: dict, measured_bytes: int) -> dict:
    """The CUDA rehearsal's peak of the same configuration (``rehearse --json``'s report) next to the
    measured one: ``peak_ratio`` = measured / rehearsed."""
    phase, peak = max(((n, ph["peak_bytes"]) for n, ph in report["phases"].items()), key=lambda kv: kv[1])
    return {"rehearsed_peak_bytes": peak, "rehearsed_phase": phase, "rehearsed_device": report.get("device"),
            "peak_ratio": measured_bytes / peak if peak else None}


def check_fp8(args) -> dict:
    # on CUDA bf16 is the throughput runs' precision already: the same run as throughput_llama_1b
    base = [*_sizes(args, "throughput_llama_1b"), *([] if cuda() else ["train.precision=bf16"])]
    runs = {name: megand_run(args, base + extra)[1]
            for name, extra in (("bf16", []), ("fp8_tensorwise", ["train.fp8=tensorwise"]))}
    keys = ("tokens_per_s", "step_time_median_s", "mem_peak_bytes", "loss_first", "loss_last")  # mfu: bf16 peak
    figures = {name: {k: run.get(k) for k in keys} for name, run in runs.items()}
    figures["fp8_speedup"] = runs["fp8_tensorwise"]["tokens_per_s"] / runs["bf16"]["tokens_per_s"]
    return figures


def check_compile_speedup(args) -> dict:
    """llama_1b's tokens/s with its layers compiled against eager (the same run as ``throughput_llama_1b``);
    the warm-up steps take the compilation."""
    need_cuda()
    base = _sizes(args, "throughput_llama_1b")
    runs = {name: megand_run(args, base + extra)[1]
            for name, extra in (("eager", []), ("compiled", ["train.compile=true"]))}
    keys = ("tokens_per_s", "mfu", "step_time_median_s", "mem_peak_bytes", "loss_first", "loss_last")
    figures = {name: {k: run.get(k) for k in keys} for name, run in runs.items()}
    figures["compile_speedup"] = runs["compiled"]["tokens_per_s"] / runs["eager"]["tokens_per_s"]
    return figures


def check_cp_block_kernel(args) -> dict:
    """cp=1 in a one-process group: the context-parallel attention paths against full causal SDPA, in fp32
    (the explicit block math) and in bf16 (on CUDA: the fused flash block kernel), forward and input
    gradients; and the fused block kernel against the explicit math on single blocks (causal, causal with
    more keys than queries, fully visible; GQA), backward from a merged log-sum-exp as the ring runs it."""
    import torch.distributed as dist

    from megand.core.parallel_state import init_distributed

    init_distributed()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda() else torch.device("cpu")
    seq, heads, groups, dim = (4096, 16, 4, 128) if args.sizes == "full" else (64, 4, 2, 16)
    figures = {}
    for dtype in (torch.float32, torch.bfloat16):
        figures[str(dtype).replace("torch.", "")] = _cp_paths_against_sdpa(device, dtype, seq, heads, groups, dim,
                                                                           dist.group.WORLD)
    figures["blocks"] = _fused_blocks_against_math(device, min(seq, 1024), heads, groups, dim)
    return figures


def _cp_paths_against_sdpa(device, dtype, seq, heads, groups, dim, group) -> dict:
    """Ring, all-gather and all-to-all attention in ``dtype`` against fp32 SDPA on the same (rounded) inputs.
    The error allowed is relative to torch's own SDPA in ``dtype`` (its rounding is the floor)."""
    import torch.nn.functional as F

    from megand.core.context_parallel import all_gather_attention, ring_attention
    from megand.core.context_parallel.block_kernels import blocks_for
    from megand.core.context_parallel.ulysses import ulysses_attention

    gen = torch.Generator(device=device).manual_seed(0)
    q, dout = (torch.randn(1, heads, seq, dim, device=device, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(1, groups, seq, dim, device=device, generator=gen).to(dtype) for _ in range(2))

    def run(attention, cast=None):
        leaves = [(t if cast is None else t.to(cast)).clone().requires_grad_() for t in (q, k, v)]
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = attention(*leaves)
        out.backward(dout if cast is None else dout.to(cast))
        if device.type == "cuda":
            torch.cuda.synchronize()
        return [out.detach().float()] + [t.grad.float() for t in leaves], time.perf_counter() - start

    def sdpa(q_, k_, v_):
        return F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, enable_gqa=True)

    def error(results):
        return max(((a - r).abs().max() / r.abs().max()).item() for a, r in zip(results, reference))

    reference, _ = run(sdpa, cast=torch.float32)
    same_dtype, sdpa_s = run(sdpa)
    floor = error(same_dtype)  # 0 in fp32
    allowed = max(4 * floor, 1e-4)
    figures = {"sdpa_s": sdpa_s, "sdpa_rel_err": floor, "fused_blocks": blocks_for(q).fused}
    for name, fn in (("ring", ring_attention), ("all_gather", all_gather_attention), ("a2a", ulysses_attention)):
        results, seconds = run(lambda q_, k_, v_: fn(q_, k_, v_, group))
        err = error(results)
        if err > allowed:
            raise RuntimeError(f"{name} ({dtype}): relative error {err:.3g} from fp32 SDPA, allowed {allowed:.3g} "
                               f"(4x torch's own SDPA in this dtype)")
        figures[name] = {"seconds": seconds, "rel_err": err}
    return figures


def _fused_blocks_against_math(device, seq, heads, groups, dim) -> dict:
    """On CUDA: the flash block kernel (bf16) against the explicit fp32 math on the same inputs."""
    if device.type != "cuda":
        return {"skipped": "needs CUDA (the CPU path is the explicit math; tests cover the fused path on CPU)"}
    from megand.core.context_parallel.block_kernels import CUDA_FLASH, ExplicitBlocks, FusedBlocks

    gen = torch.Generator(device=device).manual_seed(1)
    q, dout = (torch.randn(1, heads, seq, dim, device=device, generator=gen, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, groups, 2 * seq, dim, device=device, generator=gen, dtype=torch.bfloat16) for _ in range(2))
    fused, explicit, scale = FusedBlocks(CUDA_FLASH), ExplicitBlocks(), dim ** -0.5
    worst = 0.0
    blocks = [(slice(seq, None), True), (slice(None), True), (slice(0, seq), False)]  # square, non-square, visible
    for ks, causal in blocks:
        out, lse = explicit.forward(q, k[:, :, ks], v[:, :, ks], scale, causal)
        mine = fused.forward(q, k[:, :, ks], v[:, :, ks], scale, causal)
        delta = (dout.float() * out).sum(-1)
        grads = explicit.backward(dout, q, k[:, :, ks], v[:, :, ks], out, lse, delta, scale, causal)
        my_grads = fused.backward(dout, q, k[:, :, ks], v[:, :, ks], out, lse, delta, scale, causal)
        for a, r in zip((*mine, *my_grads), (out, lse, *grads)):
            worst = max(worst, ((a - r).abs().max() / r.abs().max().clamp_min(1e-6)).item())
    if worst > 2e-2:  # bf16 inputs and outputs: 8 bits of mantissa
        raise RuntimeError(f"fused block kernel: relative error {worst:.3g} from the explicit math")
    return {"rel_err": worst}


def check_fused_adamw(args) -> dict:
    need_cuda()
    with tiny_trainer([]) as trainer:
        opt = trainer.optimizer
        if not (opt.fused or opt.use_apex):
            raise RuntimeError("the optimizer chose neither torch's fused AdamW nor apex's on CUDA")
        return {"adamw": "apex" if opt.use_apex else "torch fused", "losses": steps(trainer)}


def check_memory_stats(args) -> dict:
    need_cuda()
    from megand.training.pretrain import peak_memory_bytes

    with tiny_trainer([]) as trainer:
        steps(trainer, 1)
        peak = peak_memory_bytes(trainer.topo.device)
    if peak <= 0:
        raise RuntimeError(f"peak memory {peak} bytes")
    return {"peak_bytes": peak}


def check_async_checkpoint(args) -> dict:
    save = tempfile.mkdtemp(prefix="megand_gpu_check_ckpt_")
    with tiny_trainer(["train.iters=2", f"checkpoint.save={save}", "checkpoint.interval=1",
                       "checkpoint.async_save=true", "train.log_interval=2"]) as trainer:
        trainer.run()
    saved = sorted(x for x in os.listdir(save) if x.startswith("iter_") and not x.endswith(".tmp"))
    if len(saved) < 1:
        raise RuntimeError(f"no checkpoint written in {save}: {os.listdir(save)}")
    return {"checkpoints": saved}


def check_compile(args) -> dict:
    from torch._dynamo.utils import counters

    from megand.tools.kernel_probes import compiled_entries

    counters.clear()
    with tiny_trainer(["train.compile=true"]) as trainer:
        start = time.perf_counter()
        losses = steps(trainer, 3)
    breaks = {str(k): v for k, v in counters["graph_break"].items()}
    versions = {}  # each compiled layer function (shared by identical layers): its compiled versions
    for chunk in trainer.chunks:
        for layer in chunk.layers.values():  # the body each layer compiles (TransformerLayer.compile_body)
            fn = type(layer)._forward
            versions[fn.__qualname__] = compiled_entries(fn)
    figures = {"losses": losses, "first_steps_s": time.perf_counter() - start,
               "layers_compile_s": trainer.compile_timer.seconds, "graph_breaks": sum(breaks.values()),
               "graph_break_reasons": dict(sorted(breaks.items(), key=lambda kv: -kv[1])[:5]),
               "compiled_versions": versions, "unique_graphs": counters["stats"]["unique_graphs"]}
    recompiled = {name: n for name, n in versions.items() if n > 1}
    if recompiled or not versions:
        raise CheckFailed(f"compiled layer functions recompiled: {recompiled} versions (one expected; "
                          f"TORCH_LOGS=recompiles names the guard that failed)" if recompiled else
                          "no compiled layer function found", figures)
    return figures


def check_wgrad_fusion(args) -> dict:
    need_cuda()
    from megand.core.tensor_parallel import wgrad

    torch.manual_seed(0)
    grads = torch.randn(4, 4096, 1024, device="cuda", dtype=torch.bfloat16)  # 4 micro-batches' output grads
    inputs = torch.randn(4, 4096, 2048, device="cuda", dtype=torch.bfloat16)
    main = torch.zeros(1024, 2048, device="cuda")
    gemm = wgrad.AccumulatingGemm()
    for g, x in zip(grads, inputs):
        gemm(main, g.t(), x)
    exact = sum(g.double().t() @ x.double() for g, x in zip(grads, inputs))
    relative = ((main.double() - exact).norm() / exact.norm()).item()
    fp32_result = gemm.takes_out_dtype(main, grads)  # the accumulating GEMM: bf16 operands added into fp32 in place
    if relative > 1e-5:  # either way the products are accumulated at fp32
        raise RuntimeError(f"relative error {relative:.2e} of the fp32-accumulated bf16 products")
    return {"relative_error": relative, "addmm_out_dtype_fp32": fp32_result}


def _rel(a, r) -> float:
    return ((a.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-6)).item()


def check_grouped_gemm(args) -> dict:
    need_cuda()
    from megand.core.transformer.moe import grouped_linear

    experts, h, f = (8, 4096, 1792) if args.sizes == "full" else (4, 64, 32)
    counts = torch.tensor([3, 0, 5, 8] * (experts // 4)) * (64 if args.sizes == "full" else 1)
    rows = int(counts.sum())
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, h, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = torch.randn(experts, f, h, device="cuda", generator=gen, dtype=torch.bfloat16) * h ** -0.5
    offsets = counts.cumsum(0).to(torch.int32).cuda()
    results = {}
    for fused in (True, False):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = grouped_linear(xs, ws, counts.cuda(), offsets, fused=fused)
        out.float().square().sum().backward()
        results[fused] = (out.detach(), xs.grad, ws.grad)
    err = max(_rel(a, r) for a, r in zip(results[True], results[False]))
    if err > 2e-2:
        raise RuntimeError(f"grouped GEMM: relative error {err:.3g} from the loop over experts (bf16)")
    return {"rel_err": err, "rows": rows, "experts": experts}


def check_flex_documents(args) -> dict:
    need_cuda()
    import torch.nn.functional as F

    from megand.core.transformer.documents import DocumentMask, dense_document_mask, document_ids

    seq, heads, groups, dim = (4096, 16, 4, 128) if args.sizes == "full" else (256, 4, 2, 64)
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(1, 100, (1, seq), device="cuda", generator=gen)
    tokens[0, torch.randint(0, seq, (8,), device="cuda", generator=gen)] = 0  # document ends
    ids = document_ids(tokens, eod_id=0)
    q = torch.randn(1, heads, seq, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    k, v = (torch.randn(1, groups, seq, dim, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    pos = torch.arange(seq, device="cuda")
    mask = dense_document_mask(ids, ids, pos, pos)
    results = []
    for attend in (lambda *t: DocumentMask(ids).attend(*t),
                   lambda q_, k_, v_: F.scaled_dot_product_attention(q_.float(), k_.float(), v_.float(), attn_mask=mask,
                                                                      enable_gqa=True)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attend(*leaves)
        out.float().square().sum().backward()
        results.append([out.detach()] + [t.grad for t in leaves])
    err = max(_rel(a, r) for a, r in zip(*results))
    if err > 3e-2:
        raise RuntimeError(f"FlexAttention with document masks: relative error {err:.3g} from the dense mask (fp32)")
    return {"rel_err": err, "documents": int(ids.max()) + 1, "seq": seq}


def check_sdpa_backend(args) -> dict:
    need_cuda()
    import torch.nn.functional as F

    from megand.core.sdpa import causal_attention
    from megand.tools.kernel_probes import attention_seen

    seq, heads, groups, dim = (4096, 32, 8, 64) if args.sizes == "full" else (256, 4, 2, 64)  # llama_1b's heads
    device = torch.device("cuda", torch.cuda.current_device())
    figures = {}
    for label, dtype in (("bf16", torch.bfloat16), ("fp32_gqa", torch.float32)):
        q = torch.randn(1, heads, seq, dim, device=device, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(1, groups, seq, dim, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
        paths = {"layers": lambda: causal_attention(q, k, v),
                 "torch_sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)}
        figures[label] = {}
        for path, attend in paths.items():
            attend().float().sum().backward()  # warm: the kernels' first-call set-up stays out of the profile
            figures[label][path] = attention_seen(lambda: attend().float().sum().backward(), device)
        figures[label]["runs"] = figures[label]["layers"]["backend"]
    return figures


NCCL_RUN_TIMEOUT_S = 240
NCCL_LAYOUTS = {2: {"tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
                    "pp2_vpp2": ["parallel.pp=2", "parallel.vpp=2"], "cp2": ["parallel.cp=2"],
                    "zero3": ["optim.sharding=optim_grads_params"],
                    "ep2": ["model=moe_tiny", "parallel.ep=2"]},
                8: {"tp2_pp2_dp2_sp": ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"],
                    "cp2_dp4_zero3": ["parallel.cp=2", "optim.sharding=optim_grads_params"],
                    "ep4_tp2": ["model=moe_tiny", "parallel.tp=2", "parallel.sequence_parallel=true",
                                "parallel.ep=4"]}}


def _torchrun_losses(nproc: int, overrides: list[str], run_dir: str, timeout: float) -> list[float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(ROOT, "pretrain_gpt.py"), "+experiment=tiny_llama", "train.iters=3", "train.log_interval=1",
           "train.eval_iters=0", f"run_dir={run_dir}", *overrides]
    env = child_env(NVIDIA_TF32_OVERRIDE="0")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun {nproc} x {' '.join(overrides)}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f if '"loss"' in line]


def check_nccl_parity(args) -> dict:
    gpus = torch.cuda.device_count() if cuda() else 0
    if gpus < 2:
        raise Skipped(f"needs 2 or more CUDA devices for NCCL runs (found {gpus})")
    figures = {}
    for nproc, layouts in NCCL_LAYOUTS.items():
        if nproc > gpus:
            figures[f"{nproc}_ranks"] = f"skipped: needs {nproc} GPUs (found {gpus})"
            continue
        for name, overrides in layouts.items():
            model = [o for o in overrides if o.startswith("model=")]
            ref = _torchrun_losses(1, model, tempfile.mkdtemp(prefix="megand_gpu_check_"), NCCL_RUN_TIMEOUT_S)
            mine = _torchrun_losses(nproc, overrides, tempfile.mkdtemp(prefix="megand_gpu_check_"), NCCL_RUN_TIMEOUT_S)
            worst = max(abs(a - b) / abs(b) for a, b in zip(mine, ref))
            figures[f"{nproc}x_{name}"] = {"losses": mine, "reference": ref, "max_rel_diff": worst}
            if worst > 1e-4:
                raise RuntimeError(f"NCCL {nproc} ranks {name}: step losses differ by {worst:.2e} (relative) from one GPU")
    return figures


def run_check(name, args) -> dict:
    fn = THROUGHPUT.get(name) and (lambda a: check_throughput(a, name)) or globals()[f"check_{name}"]
    start = time.perf_counter()
    if cuda():  # each check's own peak
        torch.cuda.reset_peak_memory_stats()
    try:
        figures = fn(args)
        status, error = "ok", None
    except Skipped as e:
        figures, status, error = {}, "skipped", str(e)
    except CheckFailed as e:
        figures, status, error = e.figures, "failed", str(e)
    except Exception as e:  # a failed check is reported; the others still run
        figures, status, error = {}, "failed", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=5)}"
    # the check's models (their hooks make reference cycles) must not hold GPU memory through the next one
    gc.collect()
    if cuda():
        torch.cuda.empty_cache()
    if cuda() and status == "ok":
        figures["peak_bytes"] = torch.cuda.max_memory_allocated()
    seconds = round(time.perf_counter() - start, 2)
    budgeted = args.sizes == "full" and cuda() and status != "skipped"  # the budgets are one H200's, full sizes
    return {"name": name, "status": status, "seconds": seconds, "figures": figures, "error": error,
            "needs": NEEDS.get(name), "budget_s": BUDGET_S[name],
            "over_budget": budgeted and seconds > BUDGET_S[name]}


def table(results) -> str:
    lines = [f"{'check':<22} {'status':<8} {'seconds':>8} {'budget':>7}  figures (or why skipped / failed)"]
    for r in results:
        figures = r["error"].splitlines()[0] if r["error"] else json.dumps(r["figures"], default=str)[:120]
        budget = f"{r['budget_s']}{'!' if r['over_budget'] else ''}"
        lines.append(f"{r['name']:<22} {r['status']:<8} {r['seconds']:>8.1f} {budget:>7}  {figures}")
    total = sum(r["seconds"] for r in results)
    over = [r["name"] for r in results if r["over_budget"]]
    lines.append(f"total {total:.0f} s; over budget (marked !): {', '.join(over) if over else 'none'}")
    return "\n".join(lines)


def rehearse_first(path: str) -> dict:
    """On a CPU build of torch: the CUDA rehearsal (an H200 profile, one rank) of each throughput check's
    full-size configuration, one micro-batch per step as the check runs it, written to ``path`` for
    ``--rehearsal`` on the GPU machine."""
    from megand.tools import fake_cuda

    reports = {}
    for name, (full, _) in THROUGHPUT.items():
        argv = [*full, "train.precision=bf16", "--world-size", "1", "--microbatches", "1", "--device", "cuda",
                "--device-profile", "h200", "--json"]
        try:
            proc = fake_cuda.run_child("megand.tools.rehearse:main", argv, capture_output=True, text=True)
        except fake_cuda.RuntimeUnavailable as e:
            raise SystemExit(f"gpu_check: --rehearse-first: {e}")
        lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
        if not lines:
            raise SystemExit(f"gpu_check: the rehearsal of {name} failed (exit {proc.returncode}): "
                             f"{(proc.stderr.strip().splitlines() or [''])[-1]}")
        reports[name] = json.loads(lines[-1])
        peak = max(ph["peak_bytes"] for ph in reports[name]["phases"].values())
        print(f"{name}: rehearsed peak {peak / 2**30:.2f} GiB on {reports[name]['device']}", flush=True)
    with open(path, "w") as f:
        json.dump(reports, f, indent=1)
    print(f"rehearsal figures: {path}")
    return reports


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu_check.json", help="the JSON report")
    p.add_argument("--sizes", choices=("full", "tiny"), default="full")
    p.add_argument("--preset", choices=sorted(PRESETS), default="check",
                   help="check: every check but compile_speedup (5 minutes on one H200); first: all of them and "
                        "10 timed steps per throughput run, the figures of a GPU's first run (about 10 minutes)")
    p.add_argument("--only", nargs="+", choices=CHECKS, default=None, help="run only these checks")
    p.add_argument("--steps", type=int, default=None, help="timed steps per throughput run (default 5; first: 10)")
    p.add_argument("--tests-timeout", type=float, default=2.0 * BUDGET_S["tests"],
                   help="seconds for the test-suite check")
    p.add_argument("--rehearsal", default=None,
                   help="the CUDA rehearsal's figures of the throughput configurations (--rehearse-first's file): "
                        "their peaks next to the measured ones")
    p.add_argument("--rehearse-first", metavar="PATH", default=None,
                   help="on a CPU build of torch: rehearse the throughput configurations on an H200 profile, write "
                        "PATH, run no check")
    p.add_argument("--list", action="store_true", help="list the checks and what each needs, run nothing")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 10 if args.preset == "first" else 5
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    if args.rehearsal is not None:
        try:
            with open(args.rehearsal) as f:
                args.rehearsal = json.load(f)
        except (OSError, ValueError) as e:
            p.error(f"--rehearsal {args.rehearsal}: {e}")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.list:
        for name in CHECKS:
            needs = 'needs ' + NEEDS[name] if name in NEEDS else 'runs anywhere'
            preset = "" if name in PRESETS["check"] else "  (--preset first)"
            print(f"{name:<22} {needs:<24} budget {BUDGET_S[name]:>4} s{preset}")
        return []
    if args.rehearse_first:
        rehearse_first(args.rehearse_first)
        return []
    device = torch.cuda.get_device_name() if cuda() else "cpu (no CUDA)"
    _RUNS.clear()
    results = [run_check(name, args) for name in (args.only or PRESETS[args.preset])]
    report = {"device": device, "torch": torch.__version__, "sizes": args.sizes, "preset": args.preset,
              "steps": args.steps, "checks": results}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"device: {device}, torch {torch.__version__}\n" + table(results) + f"\nreport: {args.out}", flush=True)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return results
