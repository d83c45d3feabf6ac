"""Causal self-attention on the fused kernel that takes the shape, and the name of that kernel.

On CUDA the kernel is chosen here, not by ``scaled_dot_product_attention``'s dispatcher, because torch's
rules fall back to the math kernel (which materialises ``s x s`` probabilities per head) for two common
training shapes:

- fp32: flash attention takes only bf16/fp16; memory-efficient attention takes fp32 but not grouped
  query heads (GQA). Here fp32 runs memory-efficient attention with K/V expanded to the query heads
  (``heads / groups`` times the K/V activations, O(s), instead of O(s^2) scores).
- head dim above 256 (flash's limit): memory-efficient attention, K/V expanded likewise.

bf16/fp16 with a head dim up to 256 (a multiple of 8) runs flash attention, grouped heads natively. The
fused kernels are called directly (their autograd formulas are torch's own), so what runs is what
:func:`attention_backend` names, also on the fake CUDA tensors of a rehearsal. Elsewhere (CPU) torch's
own choice runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FLASH_DTYPES = (torch.bfloat16, torch.float16)
FLASH_MAX_HEAD_DIM = 256
# flash backward with a head dim above 192 is refused on these consumer architectures (sm 8.6, 8.9, 12.x)
_FLASH_SMALL_SMEM = {(8, 6), (8, 9), (12, 0), (12, 1)}


def _capability(device: torch.device):
    """The CUDA compute capability of ``device``; None where no CUDA runtime answers (fake CUDA tensors
    of a rehearsal on a CPU build: a current data-centre GPU is assumed). Read from the device's
    properties, which torch.compile folds into a constant (no graph break at the CUDA query)."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device)
    return props.major, props.minor


def attention_backend(device: torch.device | str, dtype: torch.dtype, head_dim: int, heads: int, groups: int) -> str:
    """The kernel :func:`causal_attention` runs for queries with ``heads`` heads and K/V with ``groups``:
    ``"flash"``, ``"efficient"`` (memory-efficient attention; ``"efficient (K/V expanded)"`` when
    groups < heads), or on other devices torch's choice: ``"math"`` (``s x s`` scores), ``"flash"``..."""
    device = torch.device(device)
    if device.type == "cuda":
        cap = _capability(device)
        if cap is not None and cap < (8, 0):
            return "torch (pre-sm80 GPU)"
        flash_dim_ok = head_dim % 8 == 0 and head_dim <= (192 if cap in _FLASH_SMALL_SMEM else FLASH_MAX_HEAD_DIM)
        if dtype in FLASH_DTYPES and flash_dim_ok:
            return "flash"
        if head_dim % 8 == 0:
            return "efficient" if groups == heads else "efficient (K/V expanded)"
        return "math"  # what torch falls back to for head dims the fused kernels refuse
    q = torch.empty(1, heads, 1, head_dim, dtype=dtype, device="cpu")
    k = torch.empty(1, groups, 1, head_dim, dtype=dtype, device="cpu")
    choice = torch._fused_sdp_choice(q, k, k, is_causal=True, enable_gqa=groups != heads)
    return torch.nn.attention.SDPBackend(choice).name.lower().replace("_attention", "")


def _flash(q, k, v, dropout_p, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, True, False, scale=scale)[0]


def _efficient(q, k, v, dropout_p, scale):
    needs_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))  # backward reads it
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, needs_lse, dropout_p, True,
                                                                  scale=scale)[0]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                     scale: float | None = None, backend: str | None = None) -> torch.Tensor:
    """Causal attention of ``q [b, heads, s, d]`` over ``k, v [b, groups, s, d]`` (heads % groups == 0)
    on the kernel :func:`attention_backend` names (``backend`` overrides it: tests). Dropout draws from
    the device's current generator."""
    heads, groups = q.shape[1], k.shape[1]
    if backend is None and q.is_cuda:
        backend = attention_backend(q.device, q.dtype, q.shape[-1], heads, groups)
    if backend == "flash":
        return _flash(q, k, v, dropout_p, scale)
    if backend is not None and backend.startswith("efficient"):
        if groups != heads:  # the kernel takes no grouped heads: each K/V head serves heads/groups queries
            k, v = (t.repeat_interleave(heads // groups, dim=1) for t in (k, v))
        return _efficient(q, k, v, dropout_p, scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, scale=scale,
                                          enable_gqa=groups != heads)


def attention_summary(device, dtype: torch.dtype, head_dim: int, heads: int, groups: int, cp: int = 1,
                      cp_comm: str = "p2p", documents: bool = False) -> str:
    """What runs the attention of a layer, in words (the start-up log line): ``heads``/``groups`` per
    tensor-parallel rank, ``cp`` the context-parallel size, ``documents`` attention within documents."""
    device = torch.device(device)
    if cp > 1 and cp_comm in ("p2p", "all_gather"):
        from megand.core.context_parallel.block_kernels import FUSED_DTYPES

        fused = device.type == "cuda" and dtype in FUSED_DTYPES and head_dim % 8 == 0 and head_dim <= 256
        kernel = "flash blocks" if fused else "explicit fp32 blocks (one s/cp x s/cp score block at a time)"
        if documents:
            kernel += "; blocks cut by documents on the explicit fp32 math"
        return f"context-parallel {cp_comm} attention on {kernel}"
    if cp > 1:  # a2a: the whole sequence on heads/cp heads
        heads, groups = heads // cp, max(groups // cp, 1) if groups % cp == 0 else heads // cp
    if documents:
        return ("FlexAttention with a document block mask" if device.type == "cuda"
                else "SDPA with a dense document mask (s x s booleans)")
    return f"SDPA {attention_backend(device, dtype, head_dim, heads, groups)}"
