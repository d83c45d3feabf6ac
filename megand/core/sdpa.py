"""Causal self-attention through torch's ``scaled_dot_product_attention``, and the name of the kernel
it runs.

The layer calls SDPA with grouped K/V (``enable_gqa``) and lets torch's dispatcher choose the kernel:
on CUDA, torch >= 2.9 prefers cuDNN's attention on SM 9.0 and 10.x (with a recent cuDNN), else
FlashAttention-2 for fp16/bf16, the memory-efficient kernel for fp32 or head dims above flash's 256,
and the math kernel (``s x s`` probabilities) only where none takes the shape. cuDNN and flash take
grouped K/V; torch's memory-efficient kernel does not (its documentation: GQA on flash and math only),
so where it is the one fused kernel for the shape (fp32, or a head dim above 256, with fewer K/V
heads than query heads) K/V are expanded to the query heads first (``heads / groups`` times the K/V
activations, O(s), instead of the math kernel's O(s^2) scores). Kernels are called by name only where
a feature needs one: context parallelism's blocks need the log-sum-exp
(megand/core/context_parallel/block_kernels.py), document masks run FlexAttention
(megand/core/transformer/documents.py).

:func:`cuda_sdpa_backend` is torch's CUDA choice written down (what a rehearsal on fake CUDA tensors
and the start-up log name when no GPU answers); on a GPU :func:`attention_backend` asks torch itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LOW_PRECISION = (torch.bfloat16, torch.float16)
# flash backward with a head dim in (192, 224] (or (224, 256] with dropout) is refused on these architectures
_FLASH_SMALL_SMEM = {(8, 6), (8, 7), (8, 9), (12, 0), (12, 1)}
ASSUMED_CAPABILITY = (9, 0)  # no CUDA runtime answers (fake CUDA tensors): a current data-centre GPU


def _capability(device: torch.device):
    """The CUDA compute capability of ``device``; None where no CUDA runtime answers (fake CUDA tensors
    of a rehearsal on a CPU build: a current data-centre GPU is assumed). Read from the device's
    properties, which torch.compile folds into a constant (no graph break at the CUDA query)."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device)
    return props.major, props.minor


def _torch_prefers_cudnn(capability) -> bool:
    """torch >= 2.9 puts cuDNN attention first on SM 9.0 and 10.x (given cuDNN > 9.15, which its CUDA 13
    wheels carry); before, and elsewhere, cuDNN comes after math in its order."""
    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    return version >= (2, 9) and (capability == (9, 0) or capability[0] == 10)


def cuda_sdpa_backend(capability, dtype: torch.dtype, heads: int, groups: int, head_dim: int,
                      v_head_dim: int | None = None, seq_q: int = 2, seq_k: int = 2, mask: bool = False,
                      dropout_p: float = 0.0, is_causal: bool = True, enable_gqa: bool = False,
                      requires_grad: bool = True) -> str:
    """The backend torch's CUDA SDPA dispatcher chooses (SM 8.0+): ``"cudnn"``, ``"flash"``,
    ``"efficient"`` or ``"math"``, for queries ``[b, heads, seq_q, head_dim]`` over K/V with ``groups``
    heads (``capability`` None: :data:`ASSUMED_CAPABILITY`). Written from torch's ``sdp_utils.cpp``
    (the checks a training shape meets; nested tensors and ROCm left out)."""
    capability = tuple(capability or ASSUMED_CAPABILITY)
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    grouped_ok = groups == heads or (enable_gqa and heads % groups == 0)
    low = dtype in LOW_PRECISION
    cudnn = (low and grouped_ok and head_dim % 8 == 0 and v_head_dim % 8 == 0 and max(head_dim, v_head_dim) <= 128
             and seq_k != 1 and dropout_p * 16 == int(dropout_p * 16)
             and not torch.are_deterministic_algorithms_enabled())
    small_smem_refuses = (requires_grad and capability in _FLASH_SMALL_SMEM
                          and (192 < head_dim <= 224 or (head_dim > 224 and dropout_p > 0)))
    flash = (low and grouped_ok and not mask and head_dim == v_head_dim and head_dim <= 256
             and not small_smem_refuses and not (is_causal and seq_q != seq_k))
    alignment = 8 if low else 4
    efficient = (dtype in (*LOW_PRECISION, torch.float32) and groups == heads and head_dim % alignment == 0
                 and v_head_dim % alignment == 0)  # no grouped K/V
    if cudnn and _torch_prefers_cudnn(capability):
        return "cudnn"
    if flash:
        return "flash"
    return "efficient" if efficient else "math"


def _expands(device: torch.device, dtype: torch.dtype, head_dim: int, heads: int, groups: int) -> bool:
    """Whether :func:`causal_attention` expands grouped K/V on this CUDA device: no fused kernel takes them
    grouped, the memory-efficient one takes them expanded."""
    if groups == heads or device.type != "cuda":
        return False
    capability = _capability(device)
    return (cuda_sdpa_backend(capability, dtype, heads, groups, head_dim, enable_gqa=True) == "math"
            and cuda_sdpa_backend(capability, dtype, heads, heads, head_dim) == "efficient")


def expands_kv(device: torch.device, dtype: torch.dtype, head_dim: int, heads: int, groups: int) -> bool:
    """:func:`causal_attention`'s decision at each call (the rehearsal counts the calls that expand)."""
    return _expands(device, dtype, head_dim, heads, groups)


def heads_first(x: torch.Tensor) -> torch.Tensor:
    """``x [s, b, heads, d]`` as the ``[b, heads, s, d]`` operand of :func:`causal_attention`: a view, except on
    the CPU, whose flash kernel runs forward and backward ~7 % faster on queries and keys laid out densely
    in that order (a compiled layer writes them so in the kernel that makes them). Only for tensors made
    for attention (the rotated queries and keys), which the copy replaces: a copy of a view into the fused
    projection's output would be kept for backward besides that output."""
    x = x.permute(1, 2, 0, 3)
    return x.contiguous() if x.device.type == "cpu" else x


def attention_backend(device: torch.device | str, dtype: torch.dtype, head_dim: int, heads: int, groups: int) -> str:
    """The kernel :func:`causal_attention` runs for queries with ``heads`` heads and K/V with ``groups``:
    ``"cudnn"``, ``"flash"``, ``"efficient"`` (``"efficient (K/V expanded)"``) or ``"math"`` (``s x s``
    scores): torch's own choice where its dispatcher answers (the CPU, a GPU), else (fake CUDA tensors)
    :func:`cuda_sdpa_backend`'s."""
    device = torch.device(device)
    if _expands(device, dtype, head_dim, heads, groups):
        return "efficient (K/V expanded)"
    if device.type == "cuda" and _capability(device) is None:
        return cuda_sdpa_backend(None, dtype, heads, groups, head_dim, seq_q=128, seq_k=128, enable_gqa=groups != heads)
    q = torch.empty(1, heads, 128, head_dim, dtype=dtype, device=device, requires_grad=True)
    k = torch.empty(1, groups, 128, head_dim, dtype=dtype, device=device, requires_grad=True)
    choice = torch._fused_sdp_choice(q, k, k, is_causal=True, enable_gqa=groups != heads)
    return torch.nn.attention.SDPBackend(choice).name.lower().replace("_attention", "")


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                     scale: float | None = None) -> torch.Tensor:
    """Causal attention of ``q [b, heads, s, d]`` over ``k, v [b, groups, s, d]`` (heads % groups == 0),
    on the kernel SDPA's dispatcher chooses (K/V grouped, or expanded where only the memory-efficient
    kernel takes the shape). Dropout draws from the device's current generator."""
    heads, groups = q.shape[1], k.shape[1]
    if expands_kv(q.device, q.dtype, q.shape[-1], heads, groups):  # each K/V head serves heads/groups queries
        k, v = (t.repeat_interleave(heads // groups, dim=1) for t in (k, v))
        groups = heads
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
