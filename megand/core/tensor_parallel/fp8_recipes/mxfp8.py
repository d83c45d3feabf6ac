"""``mxfp8``: OCP MX block scaling, one power-of-two scale per 32 consecutive elements along ``k`` (an e8m0
exponent, ``floor(log2(amax)) - emax`` of the element format), elements saturating at ``fmax``; e4m3 output
gradients (the block scales leave them the range). Its kernel (SM 10.0+, Blackwell) takes e4m3 operands,
whole blocks along ``k``, e8m0 scales in cuBLAS's blocked layout, a bf16 result and no fast accumulation.
The routed experts run per expert through the dense products (the grouped MX kernel needs token counts that
are multiples of 32). A GPU without the kernel refuses it: emulated there, it runs slower than bf16."""

import torch

from megand.core.tensor_parallel.fp8_recipes.record import Fp8Recipe
from megand.core.tensor_parallel.fp8_recipes.scaling import E4M3, E5M2, fmax

MX_BLOCK = 32
EMAX = {E4M3: 8, E5M2: 15}  # the largest normal exponent of each element format (448 = 1.75 * 2^8)


def mx_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The power-of-two block scale ``2^(floor(log2(amax)) - emax)``, its exponent clamped to e8m0's range
    [-127, 127] (an all-zero block: 2^-127)."""
    _, exponent = torch.frexp(amax)  # amax = m * 2^e, m in [0.5, 1): floor(log2(amax)) = e - 1
    exponent = torch.where(amax > 0, exponent - 1 - EMAX[dtype], -127).clamp(-127, 127)
    return torch.ldexp(torch.ones_like(amax), exponent)


def quantize(t: torch.Tensor, dtype: torch.dtype, dim: int, group=None):
    """``(data, scale)``: the scales ``t``'s shape with ``dim`` cut into blocks of 32 (the last one possibly
    shorter); ``group`` is not used (a block's scale is its own)."""
    src = t.float()
    length = src.shape[dim]
    blocks = -(-length // MX_BLOCK)
    padded = torch.nn.functional.pad(src.abs(), (0, blocks * MX_BLOCK - length) if dim == 1
                                     else (0, 0, 0, blocks * MX_BLOCK - length))
    shape = (padded.shape[0], blocks, MX_BLOCK) if dim == 1 else (blocks, MX_BLOCK, padded.shape[1])
    scale = mx_scale(padded.view(shape).amax(dim=dim + 1), dtype)
    expanded = scale.repeat_interleave(MX_BLOCK, dim=dim).narrow(dim, 0, length)
    return (src / expanded).clamp(-fmax(dtype), fmax(dtype)).to(dtype), scale


def mx_blocked_scales(scale: torch.Tensor) -> torch.Tensor:
    """MX block scales ``[rows, k / 32]`` (fp32 powers of two) as cuBLAS reads them: e8m0 bytes in tiles
    of 128 rows x 4 blocks (zero-padded to whole tiles), the tiles in row-major order, 512 bytes each;
    inside a tile, row ``r`` and block ``c`` at byte ``(r % 32) * 16 + (r // 32) * 4 + c``."""
    rows, cols = scale.shape
    tiles_r, tiles_c = -(-rows // 128), -(-cols // 4)
    padded = torch.zeros(tiles_r * 128, tiles_c * 4, dtype=torch.float8_e8m0fnu, device=scale.device)
    padded[:rows, :cols] = scale.to(torch.float8_e8m0fnu)  # exact: powers of two in [2^-127, 2^127]
    # [tile row, r // 32, r % 32, tile column, c] -> [tile row, tile column, r % 32, r // 32, c]
    return padded.view(tiles_r, 4, 32, tiles_c, 4).permute(0, 3, 2, 1, 4).reshape(-1)


def _kernel_scales(scale_a, scale_b):
    # a's blocks run along its rows, b's along its columns ([n, k / 32] once turned)
    return mx_blocked_scales(scale_a), mx_blocked_scales(scale_b.t())


RECIPE = Fp8Recipe(
    name="mxfp8", granularity="block", block=MX_BLOCK, quantize=quantize,
    grad_dtype=E4M3, kernel="mx", kernel_what="FP8 products with MX block scales (SM 10.0+)",
    kernel_bf16_only=True, kernel_e4m3_only=True, kernel_scales=_kernel_scales, fast_accum=False,
    grouped_experts=False,
    needs="MX block-scaled tensor cores (compute capability 10.0+, Blackwell)",
    needs_why="emulating MX blocks on this GPU would run slower than bf16")
