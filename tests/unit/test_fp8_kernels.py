"""Which FP8 kernels a device runs (decided once, from its CUDA compute capability), MXFP8's scales in the
layout cuBLAS reads, and train.fp8=mxfp8 refused in one line on GPUs without MX tensor cores."""

import pytest
import torch

from megand.core.tensor_parallel.fp8 import Fp8Kernels, mx_blocked_scales, quantize, scaled_mm_takes
from megand.training.config import ConfigError, check_fp8_device


def test_kernels_follow_the_compute_capability():
    assert Fp8Kernels.for_capability(None) == Fp8Kernels()  # CPU: the emulation everywhere
    assert Fp8Kernels.for_capability((8, 0)) == Fp8Kernels()  # A100: no FP8 tensor cores
    assert Fp8Kernels.for_capability((8, 9)) == Fp8Kernels(tensorwise=True)  # L40S
    assert Fp8Kernels.for_capability((9, 0)) == Fp8Kernels(tensorwise=True, rowwise=True, grouped=True)  # H100
    assert Fp8Kernels.for_capability((10, 0)) == Fp8Kernels(True, True, True, True)  # B200
    assert Fp8Kernels.for_capability((12, 0)) == Fp8Kernels(tensorwise=True, rowwise=True, mx=True)


def test_mx_scales_in_cublas_blocked_layout():
    """Against the layout's definition, element by element: tiles of 128 rows x 4 blocks in row-major
    order (512 bytes each, zero-padded), row r and block c of a tile at (r % 32) * 16 + (r // 32) * 4 + c."""
    rows, cols = 200, 6  # two tile rows (the second padded), two tile columns (the second padded)
    exponents = torch.randint(-127, 128, (rows, cols), generator=torch.Generator().manual_seed(0))
    scale = torch.ldexp(torch.ones(rows, cols), exponents)
    flat = mx_blocked_scales(scale).view(torch.uint8).tolist()
    tiles_c = 2
    assert len(flat) == 2 * tiles_c * 512
    expected = [0] * len(flat)  # padding: byte 0
    for i in range(rows):
        for j in range(cols):
            tile = (i // 128) * tiles_c + j // 4
            r, c = i % 128, j % 4
            expected[tile * 512 + (r % 32) * 16 + (r // 32) * 4 + c] = int(exponents[i, j]) + 127  # e8m0 bias
    assert flat == expected


def test_mx_kernel_is_chosen_only_where_the_device_has_it():
    a = quantize(torch.randn(64, 64), "mxfp8", torch.float8_e4m3fn, 1)
    b = quantize(torch.randn(64, 32), "mxfp8", torch.float8_e4m3fn, 0)
    assert not scaled_mm_takes(a, b, torch.bfloat16, Fp8Kernels.for_capability((10, 0)))  # CPU tensors


def test_mxfp8_is_refused_on_gpus_before_blackwell(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    with pytest.raises(ConfigError) as error:
        check_fp8_device("mxfp8", torch.device("cuda", 0))
    message = str(error.value)
    assert "\n" not in message and "NVIDIA H100 80GB HBM3 is 9.0" in message and "rowwise or tensorwise" in message
    assert "slower than bf16" in message
    check_fp8_device("rowwise", torch.device("cuda", 0))
    check_fp8_device("mxfp8", torch.device("cpu"))  # the emulation
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    check_fp8_device("mxfp8", torch.device("cuda", 0))
