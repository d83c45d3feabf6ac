"""Where a rehearsed rank runs a slower path than the device's kernel: counted per source line and reported
as warnings (the rank still runs, only slower or with more memory):

- an FP8 product emulated (dequantised operands, a bf16/fp32 GEMM) because the device has no FP8 kernel for
  its recipe (``train.fp8`` on an A100, rowwise below SM 9.0, MX blocks below 10.0) or the operands'
  shapes do not suit it; the same for the FP8 grouped GEMM of the experts;
- the MoE experts as a loop over experts instead of torch's grouped GEMM (operands not bf16 or not
  16-byte aligned), and ``torch._grouped_mm`` on a device without its fused kernel (torch's fallback);
- attention on K/V expanded to the query heads (fp32 with grouped query heads, head dims above flash's
  limit: memory-efficient attention has no GQA): ``heads / groups`` times the K/V activations.

The decisions are megand's own (:mod:`megand.core.tensor_parallel.fp8`, :mod:`~megand.core.transformer.moe`,
:mod:`megand.core.sdpa`): they are wrapped while the rehearsal runs, so what is counted is what was chosen.
"""

from __future__ import annotations

from collections import Counter
from contextlib import ExitStack
from unittest import mock

EMULATED_FP8 = "FP8 product emulated (no FP8 kernel of this device takes its recipe or shapes)"
EMULATED_FP8_GROUPED = "FP8 expert products emulated (no FP8 grouped GEMM of this device takes them)"
EXPERT_LOOP = "MoE experts as a loop over experts (torch's grouped GEMM does not take the operands)"
GROUPED_FALLBACK = "torch._grouped_mm without its fused kernel on this device (torch's fallback)"
EXPANDED_KV = "attention on K/V expanded to the query heads (the fused kernel that runs has no GQA)"


class KernelFallbacks:
    """Counts of ``(warning, source line)`` while :meth:`patches` are entered; ``device``: the rehearsed
    device (:class:`~megand.tools.rehearsal_devices.RehearsedDevice`)."""

    def __init__(self, device):
        self.device = device
        self.counts: Counter = Counter()

    def record(self, warning: str) -> None:
        from megand.tools.device_rules import source_line

        self.counts[(warning, source_line())] += 1

    def patches(self, stack: ExitStack) -> None:
        from megand.core import sdpa
        from megand.core.tensor_parallel import fp8, fp8_grouped
        from megand.core.transformer import moe

        def counting(module, name, warn_if):
            original = getattr(module, name, None)
            if original is None:  # the decision is made elsewhere in this version: nothing to count
                return

            def wrapped(*args, **kwargs):
                result = original(*args, **kwargs)
                if warn_if(result, *args, **kwargs):
                    self.record(warn_if.warning)
                return result

            stack.enter_context(mock.patch.object(module, name, wrapped))

        def emulated_fp8(takes, a, *_, **__):
            return not takes and a.data.is_cuda
        emulated_fp8.warning = EMULATED_FP8

        def emulated_grouped(takes, _self, a, *_, **__):
            return not takes and a.is_cuda
        emulated_grouped.warning = EMULATED_FP8_GROUPED

        def expert_loop(fits, x, *_, **__):
            return not fits and x.is_cuda
        expert_loop.warning = EXPERT_LOOP

        def expanded(expands, *_, **__):  # megand.core.sdpa.expands_kv: the layer's decision, per call
            return bool(expands)
        expanded.warning = EXPANDED_KV

        counting(fp8, "scaled_mm_takes", emulated_fp8)
        counting(fp8_grouped.GroupedFp8, "_grouped_kernel_takes", emulated_grouped)
        counting(moe, "fused_grouped_mm_fits", expert_loop)
        counting(sdpa, "expands_kv", expanded)

    def report(self, kernels: Counter) -> list[dict]:
        """``[{"warning", "where", "count"}]``, most frequent first; ``kernels``: the device rules' count of
        CUDA-only kernels per ``(kernel, source line)`` (torch's grouped GEMM without its fused kernel)."""
        counts = Counter(self.counts)
        if not self.device.fused_grouped_gemm:
            for (kernel, where), n in kernels.items():
                if kernel == "grouped_mm":
                    counts[(f"{GROUPED_FALLBACK} ({self.device.sm})", where)] += n
        return [{"warning": w, "where": where, "count": n} for (w, where), n in counts.most_common()]
