"""What actually ran: the attention kernels a call launched (read from the profiler, not predicted from a
backend order) and how many times torch.compile compiled a function (its cache entries).

Private torch API used: ``torch._dynamo.eval_frame._debug_get_cache_entry_list`` (the compiled entries
of a code object; no public equivalent in torch 2.13).
"""

from __future__ import annotations

import re
from collections import Counter

import torch

# aten operators of scaled-dot-product attention -> the backend that ran (the most specific names first)
ATTENTION_OPS = (
    ("_scaled_dot_product_cudnn_attention", "cudnn"),
    ("_cudnn_attention", "cudnn"),
    ("_scaled_dot_product_flash_attention_for_cpu", "flash (cpu)"),
    ("_scaled_dot_product_flash_attention", "flash"),
    ("_flash_attention", "flash"),
    ("_scaled_dot_product_efficient_attention", "efficient"),
    ("_efficient_attention", "efficient"),
    ("_scaled_dot_product_fused_attention_overrideable", "overrideable"),
    ("_scaled_dot_product_attention_math", "math"),
    ("flex_attention", "flex"),
)
ATTENTION_KERNEL = re.compile(r"flash|fmha|attention|attn|cudnn|sdpa|mha", re.IGNORECASE)


def _backend(op: str) -> str | None:
    for name, backend in ATTENTION_OPS:
        if name in op:
            return backend
    return None


def attention_seen(fn, device: torch.device) -> dict:
    """Run ``fn()`` under the profiler: ``backend`` (the attention backend whose operator ran first: flash,
    efficient, cudnn, math, ...; None when no attention operator ran), ``ops`` (the attention operators,
    with counts) and ``kernels`` (on CUDA, the device kernels whose names say attention, with counts)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    ops, kernels, order = Counter(), Counter(), []
    for event in prof.events():
        name = event.name
        if event.device_type == DeviceType.CUDA:
            if ATTENTION_KERNEL.search(name):
                kernels[name[:120]] += 1
        elif name.startswith("aten::") and _backend(name):
            ops[name] += 1
            order.append((event.time_range.start, name))
    first = min(order)[1] if order else None
    return {"backend": _backend(first) if first else None, "ops": dict(ops.most_common()),
            "kernels": dict(kernels.most_common(8))}


def compiled_entries(code) -> int:
    """How many compiled versions torch.compile holds for ``code`` (a function or code object): 1 when it
    compiled once, more when a guard failed and it recompiled."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(code))
