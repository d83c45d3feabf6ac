"""What a CUDA device and NCCL would refuse or wait for, checked on fake tensors during a rehearsal.

:class:`DeviceRules` is a dispatch mode layered on the fake tensor mode. For every operation it

- fails (:class:`RehearsalError`, naming the operation and the source line of the training code that
  called it) where CUDA would: a CPU tensor meeting a CUDA tensor, GEMM operands of different dtypes,
  CUDA-only kernels called with arguments they reject (flash attention: fp16/bf16 only, head dim at most
  256 and a multiple of 8, query heads a multiple of the key/value heads; ``torch._grouped_mm``: bf16,
  16-byte aligned strides, int32 offsets on the device, a 2-D x 2-D product (groups along the contraction)
  only with the first operand column-major and the second row-major, the one layout whose kernel takes
  any group size, empty groups included (others assert on the device unless every group is a positive
  multiple of 16 bytes: values a rehearsal does not have); ``torch._scaled_grouped_mm``: e4m3 operands,
  the first row-major, the second column-major, their dims multiples of 16, fp32 per-row scales of the
  kernel's shapes, a bf16 result, no 2-D x 2-D form (its groups must be positive multiples of 16); FlexAttention:
  a block mask made for the query/key lengths and the device of the call); the FP8 kernels the rehearsed
  device lacks (``profile``: FP8 products below SM 8.9, per-row scales below 9.0, the FP8 grouped GEMM
  outside 9.0 and 10.x, MX block scales below 10.0);
- runs ``F.scaled_dot_product_attention`` (:meth:`DeviceRules.scaled_dot_product_attention`, patched in
  by the rehearsal: a CPU build does not choose CUDA's backends) with the backend torch's CUDA dispatcher
  chooses (:func:`megand.core.sdpa.cuda_sdpa_backend`: cuDNN first on SM 9.0/10.x with torch >= 2.9, then
  flash, memory-efficient, math), so a run that falls to the math kernel stores its ``s x s``
  probabilities here as on the GPU, and records which backend each call site ran;
- counts every host synchronisation: a value read (``.item()``, ``.tolist()``: one per call), a copy
  from the device to the host (but one queued without blocking into pinned memory: its wait is counted
  where the caller synchronises), a blocking host-to-device copy (``non_blocking=False``, or from pageable
  memory: CUDA stages those through a pinned buffer and waits), with its source line. Pinned memory is
  modelled (``pin_memory()`` and ``torch.empty(..., pin_memory=True)`` mark the tensor, ``is_pinned`` reads
  the mark).

Fake tensors have no values: a read returns 0 for float64 tensors (the training step's agreed values:
a finite loss, no overflow) and 1 otherwise (e.g. AdamW's step count, read on the CPU).
"""

from __future__ import annotations

import os
import sys
import weakref
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megand.core.sdpa import cuda_sdpa_backend
from megand.core.tensor_parallel.fp8_recipes import kernel_recipe

aten = torch.ops.aten
_TORCH_DIR = os.path.dirname(torch.__file__)
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_TOOLS_DIR = os.path.dirname(os.path.abspath(__file__))
_SKIP = (_TORCH_DIR, _TOOLS_DIR, os.path.dirname(os.__file__))

FLASH_DTYPES = (torch.float16, torch.bfloat16)
SDPA_BACKENDS = {0: "math", 1: "flash", 2: "efficient"}  # torch's SDPBackend values
GEMMS = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.addmm_.default, aten.baddbmm.default,
         aten.addbmm.default, aten.addmv.default, aten.mv.default, aten.dot.default}
FLASH_OPS = {aten._scaled_dot_product_flash_attention.default,
             aten._scaled_dot_product_flash_attention_backward.default}
READ_ONLY_OPS = {aten._local_scalar_dense.default, aten.unbind.int, aten.select.int, aten.detach.default}


class RehearsalError(RuntimeError):
    """An operation a CUDA device or NCCL would refuse, with where the training code called it."""


def source_line() -> str:
    """``path:line (function)`` of the innermost caller in the training code (the repository outside the
    rehearsal's own tools), else the innermost caller outside torch."""
    frame, fallback = sys._getframe(1), None
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_SKIP) and not path.startswith("<"):
            where = f"{os.path.relpath(path, _REPO_ROOT)}:{frame.f_lineno} ({frame.f_code.co_name})"
            if path.startswith(_REPO_ROOT):
                return where
            fallback = fallback or where
        frame = frame.f_back
    return fallback or "?"


def _tensors(*trees):
    return [t for t in tree_leaves(trees) if isinstance(t, torch.Tensor)]


def _device(value):
    return None if value is None else torch.device(value)


class DeviceRules(TorchDispatchMode):
    """The rules of ``device`` (``cuda``: all of them; ``cpu``: only the sync count), enforced on fake
    tensors. ``syncs``: ``[(phase, kind, source line)]``; ``backends``: Counter of
    ``(backend, source line)`` of attention calls; ``phase``: set by the rehearsal."""  # noqa

    def __init__(self, device: torch.device, profile=None):
        super().__init__()
        self.cuda = device.type == "cuda"
        self.profile = profile  # the rehearsed GPU (megand.tools.rehearsal_devices): its kernels; None: an SM 9.0
        self.phase = "build"
        self.syncs: list[list] = []  # [phase, kind, source line, count]
        self.backends: Counter = Counter()
        self.kernels: Counter = Counter()  # (CUDA-only GEMM, source line): the grouped GEMM, mm with out_dtype
        self._pinned = weakref.WeakSet()  # storages of pinned host tensors
        self._last_read = None  # (storage, line) of the last value read: one .tolist() is one sync
        self.flex_depth = 0  # inside the FlexAttention stand-in: its own rules apply
        self.sdpa_depth = 0  # inside the SDPA stand-in (its kernel call is recorded as SDPA's)

    # -- reporting -----------------------------------------------------------------------------------
    def sync(self, kind: str, where: str | None = None) -> None:
        self.syncs.append([self.phase, kind, where or source_line(), 1])

    def repeat_syncs(self, since: int, times: int) -> None:
        """Count the syncs recorded after the first ``since`` ``times`` more (a loop played once)."""
        for entry in self.syncs[since:]:
            entry[3] *= times + 1

    def step_syncs(self, phases) -> int:
        return sum(n for phase, _, _, n in self.syncs if phase in phases)

    def attention(self, backend: str, where: str | None = None) -> None:
        self.backends[(backend, where or source_line())] += 1

    def fail(self, func, message: str):
        raise RehearsalError(f"{func}: {message} (at {source_line()})")

    # -- dispatch ------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default:
            return self._read(args[0])
        if func not in READ_ONLY_OPS and func is not torch.ops.prim.device.default:
            self._last_read = None
        if func is aten.is_pinned.default:
            return args[0].untyped_storage() in self._pinned
        if func is aten._pin_memory.default:
            out = args[0].clone()
            self._pinned.add(out.untyped_storage())
            return out
        if func is aten.empty.memory_format and kwargs.get("pin_memory"):
            out = func(*args, **kwargs)
            self._pinned.add(out.untyped_storage())
            return out
        if func is aten._to_copy.default:
            self._copy(func, args[0], _device(kwargs.get("device")) or args[0].device, kwargs.get("non_blocking", False))
        elif func is aten.copy_.default:
            self._copy(func, args[1], args[0].device, args[2] if len(args) > 2 else kwargs.get("non_blocking", False),
                       dst=args[0])
        if self.cuda:
            self._check(func, args, kwargs)
        try:
            return func(*args, **kwargs)
        except RehearsalError:
            raise
        except Exception as e:  # a meta kernel's own check (device mismatch, alignment...): say where
            if not self.cuda:
                raise
            raise RehearsalError(f"{func}: {type(e).__name__}: {str(e).splitlines()[0]} (at {source_line()})") from e

    def _read(self, t):
        where = source_line()
        key = (t.untyped_storage(), where)
        on_device = not self.cuda or t.device.type == "cuda"  # a host tensor's value is read without a sync
        if on_device and (self._last_read is None or self._last_read[0] is not key[0] or self._last_read[1] != where):
            self.sync("value read (.item()/.tolist())", where)
        self._last_read = key
        if t.dtype == torch.bool:
            return False
        if t.dtype == torch.float64:
            return 0.0
        return 1 if not t.is_floating_point() else 1.0

    def _copy(self, func, src, dst_device, non_blocking, dst=None) -> None:
        if not isinstance(src, torch.Tensor) or src.device.type == dst_device.type:
            return
        if src.device.type == "cuda" and dst_device.type == "cpu":
            # into pinned memory without blocking: queued on the stream (the caller waits for it once)
            if not (non_blocking and dst is not None and dst.untyped_storage() in self._pinned):
                self.sync("device-to-host copy" + ("" if dst is None or dst.untyped_storage() in self._pinned
                                                   else " (pageable memory)"))
        elif src.device.type == "cpu" and dst_device.type == "cuda":
            pinned = src.untyped_storage() in self._pinned
            if not (non_blocking and pinned):
                self.sync("blocking host-to-device copy" + ("" if pinned else " (pageable memory)"))

    # -- CUDA's rules --------------------------------------------------------------------------------
    def _check(self, func, args, kwargs) -> None:
        if func in GEMMS:
            dtypes = {t.dtype for t in _tensors(args, kwargs)}
            if len(dtypes) > 1:
                self.fail(func, f"operands of different dtypes {sorted(map(str, dtypes))} (cuBLAS takes one)")
        elif func in FLASH_OPS and not self.flex_depth:
            forward = func is aten._scaled_dot_product_flash_attention.default
            q, k, v = args[:3] if forward else args[1:4]
            self._check_flash(func, q, k, v)
            if forward and not self.sdpa_depth:  # called directly (the context-parallel block kernels)
                self.attention("flash (aten op)")
        elif func is aten._scaled_dot_product_efficient_attention.default:
            q, k = args[0], args[1]
            if q.shape[1] != k.shape[1]:
                self.fail(func, f"memory-efficient attention has no GQA ({q.shape[1]} query heads, {k.shape[1]} "
                                f"key/value heads)")
            if not self.sdpa_depth:  # called directly (the layer's kernel choice, megand/core/sdpa.py)
                self.attention("efficient (aten op)")
        elif func is aten._grouped_mm.default:
            self._check_grouped_mm(func, args, kwargs)
            self.kernels[("grouped_mm", source_line())] += 1
        elif func is aten._scaled_grouped_mm.default:
            self._check_fp8_kernel(func, "grouped", "the FP8 grouped GEMM (SM 9.0 and 10.x)")
            self._check_scaled_grouped_mm(func, args, kwargs)
            self.kernels[("scaled_grouped_mm", source_line())] += 1
        elif func is aten._scaled_mm.default:
            scale_a = args[2] if len(args) > 2 else kwargs.get("scale_a")
            recipe = kernel_recipe(scale_a)  # the recipe whose kernel takes scales like these
            self._check_fp8_kernel(func, recipe.kernel, recipe.kernel_what)
            self.kernels[(f"scaled_mm {args[0].dtype}", source_line())] += 1
        elif func is aten.mm.dtype:
            self.kernels[(f"mm {args[0].dtype}->{args[-1]}", source_line())] += 1
        elif func is aten.addmm.dtype_out:  # the weight-gradient GEMM accumulating into the fp32 buffer
            self.kernels[(f"addmm {args[1].dtype}->{kwargs['out'].dtype}", source_line())] += 1

    def _check_fp8_kernel(self, func, kind: str, what: str) -> None:
        if self.profile is not None and not getattr(self.profile.fp8, kind):
            self.fail(func, f"{what}: the {self.profile.name} ({self.profile.sm}) has no such kernel")

    def _check_flash(self, func, q, k, v) -> None:
        dtypes = {q.dtype, k.dtype, v.dtype}
        if len(dtypes) > 1 or q.dtype not in FLASH_DTYPES:
            self.fail(func, f"flash attention takes fp16/bf16 inputs of one dtype, got {sorted(map(str, dtypes))}")
        d = q.shape[-1]
        if d > 256 or d % 8 or k.shape[-1] != d or v.shape[-1] != d:
            self.fail(func, f"flash attention takes head dims <= 256, a multiple of 8, equal for q/k/v; got "
                            f"{q.shape[-1]}/{k.shape[-1]}/{v.shape[-1]}")
        if k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1]:
            self.fail(func, f"flash attention's GQA needs query heads ({q.shape[1]}) a multiple of key/value "
                            f"heads ({k.shape[1]}/{v.shape[1]})")
        if any(t.device.type != "cuda" for t in (q, k, v)):
            self.fail(func, "flash attention on a non-CUDA tensor")

    def _check_grouped_mm(self, func, args, kwargs) -> None:
        a, b = args[0], args[1]
        offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
        if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
            self.fail(func, f"the grouped GEMM takes bf16 operands, got {a.dtype} and {b.dtype}")
        if offs is not None and (offs.dtype != torch.int32 or offs.device.type != "cuda"):
            self.fail(func, f"the grouped GEMM's offsets must be int32 on the device, got {offs.dtype} on {offs.device}")
        for name, t in (("mat_a", a), ("mat_b", b)):
            bad = [s for s in t.stride() if s != 1 and (s * t.element_size()) % 16]
            if bad or t.storage_offset() * t.element_size() % 16:
                self.fail(func, f"{name} strides {tuple(t.stride())} (x {t.element_size()} bytes) are not 16-byte "
                                f"aligned")
        if a.dim() == 2 and b.dim() == 2 and not (a.stride(0) == 1 and b.stride(-1) == 1):
            self.fail(func, f"a 2-D x 2-D grouped GEMM with strides {tuple(a.stride())} x {tuple(b.stride())}: only a "
                            f"column-major first and a row-major second operand take any group size (else every "
                            f"group must be a positive multiple of 16 bytes, asserted on the device)")

    def _check_scaled_grouped_mm(self, func, args, kwargs) -> None:
        a, b, scale_a, scale_b = args[:4]
        offs = kwargs.get("offs", args[4] if len(args) > 4 else None)
        out_dtype = kwargs.get("out_dtype", args[7] if len(args) > 7 else None)
        if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
            self.fail(func, f"the FP8 grouped GEMM takes e4m3 operands, got {a.dtype} and {b.dtype}")
        if a.dim() == 2 and b.dim() == 2:
            self.fail(func, "the 2-D x 2-D FP8 grouped GEMM needs every group a positive multiple of 16 rows "
                            "(asserted on the device); token counts per expert are not")
        if a.stride(-1) != 1 or b.stride(-2) != 1:
            self.fail(func, f"the FP8 grouped GEMM takes a row-major first and a column-major second operand, got "
                            f"strides {tuple(a.stride())} and {tuple(b.stride())}")
        if a.shape[-1] % 16 or b.shape[-2] % 16 or b.shape[-1] % 16:
            self.fail(func, f"the FP8 grouped GEMM needs dims that are multiples of 16, got {tuple(a.shape)} x "
                            f"{tuple(b.shape)}")
        rows_a = a.shape[0] if a.dim() == 2 else None
        if (scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32 or scale_a.dim() != 1
                or scale_a.shape[0] != rows_a or tuple(scale_b.shape) != (b.shape[0], b.shape[-1])):
            self.fail(func, f"the FP8 grouped GEMM takes fp32 scales [{rows_a}] and [{b.shape[0]}, {b.shape[-1]}], "
                            f"got {scale_a.dtype} {tuple(scale_a.shape)} and {scale_b.dtype} {tuple(scale_b.shape)}")
        if offs is None or offs.dtype != torch.int32 or offs.device.type != "cuda":
            self.fail(func, "the FP8 grouped GEMM's offsets must be int32 on the device")
        if out_dtype not in (None, torch.bfloat16):
            self.fail(func, f"the FP8 grouped GEMM returns bf16 only, asked for {out_dtype}")

    def sdpa_backend(self, q, k, v, attn_mask=None, enable_gqa=False, dropout_p=0.0, is_causal=False) -> str:
        """torch's CUDA SDPA backend choice on this device (:func:`megand.core.sdpa.cuda_sdpa_backend`)."""
        if q.dim() != 4 or k.shape[-1] != q.shape[-1]:
            return "math"
        capability = self.profile.capability if self.profile is not None else None  # None: an SM 9.0
        return cuda_sdpa_backend(capability, q.dtype, q.shape[1], k.shape[1], q.shape[-1], v.shape[-1], q.shape[2],
                                 k.shape[2], mask=attn_mask is not None, dropout_p=dropout_p, is_causal=is_causal,
                                 enable_gqa=enable_gqa, requires_grad=any(t.requires_grad for t in (q, k, v)))

    def scaled_dot_product_attention(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                     enable_gqa=False):
        """``F.scaled_dot_product_attention`` as on CUDA: the backend torch would choose, its kernel (the
        meta version: flash and memory-efficient keep a log-sum-exp, math its ``s x s`` probabilities)."""
        backend = "flash" if self.flex_depth else self.sdpa_backend(q, k, v, attn_mask, enable_gqa, dropout_p, is_causal)
        if not self.flex_depth:
            self.attention(f"sdpa:{backend}")
        self.sdpa_depth += 1
        try:
            lse = any(t.requires_grad for t in (q, k, v))
            if backend == "cudnn":
                return aten._scaled_dot_product_cudnn_attention(q, k, v, attn_mask, lse, dropout_p, is_causal, False,
                                                                scale=scale)[0]
            if backend == "flash":
                return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
            if backend == "efficient":
                return aten._scaled_dot_product_efficient_attention(q, k, v, attn_mask, lse, dropout_p,
                                                                    is_causal, scale=scale)[0]
            return aten._scaled_dot_product_attention_math(q, k, v, attn_mask, dropout_p, is_causal, None,
                                                           scale=scale, enable_gqa=enable_gqa)[0]
        finally:
            self.sdpa_depth -= 1

    def rms_norm(self, x, normalized_shape, weight=None, eps=None):
        """``F.rms_norm`` as CUDA runs it: one fused kernel that keeps its input and an fp32 inverse
        RMS per row for backward (a CPU build's composite keeps two fp32 copies of the input)."""
        return _FusedRmsNorm.apply(x, weight, len(normalized_shape))

    # -- summaries -----------------------------------------------------------------------------------
    def sync_table(self, phases) -> list[dict]:
        """``[{"where", "kind", "count"}]`` of the syncs in ``phases``, most frequent first."""
        counts = Counter()
        for phase, kind, where, n in self.syncs:
            if phase in phases:
                counts[(where, kind)] += n
        return [{"where": w, "kind": k, "count": n} for (w, k), n in counts.most_common()]


class _FusedRmsNorm(torch.autograd.Function):
    """Shapes, dtypes and saved tensors of CUDA's fused RMSNorm (values are not computed: fake tensors)."""

    @staticmethod
    def forward(ctx, x, weight, dims: int):
        rstd = x.new_empty(x.shape[:x.dim() - dims] + (1,) * dims, dtype=torch.float32)
        ctx.save_for_backward(x, weight, rstd)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        x, weight, _ = ctx.saved_tensors
        return torch.empty_like(x), None if weight is None else torch.empty_like(weight), None
