"""Which FP8 kernels a device runs (decided once, from its CUDA compute capability), MXFP8's scales in the
layout cuBLAS reads, and train.fp8=mxfp8 refused in one line on GPUs without MX tensor cores."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


class _ProductCalls(TorchDispatchMode):
    """Per product: the ops dispatched (kernels on a GPU), each ``torch._scaled_mm`` call's result dtype
    and fast accumulation, and the fp32 GEMMs (the emulation's product)."""

    def __init__(self):
        super().__init__()
        self.product, self.ops, self.scaled, self.fp32_gemms = None, {}, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in (torch.ops.aten.detach.default, torch.ops.aten.t.default, torch.ops.aten.view.default,
                        torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default):  # no kernel
            self.ops.setdefault(self.product, []).append(str(func))
        if func is torch.ops.aten._scaled_mm.default:
            named = {**dict(zip([a.name for a in func._schema.arguments], args)), **kwargs}
            self.scaled.append((str(named.get("out_dtype")), bool(named.get("use_fast_accum", False))))
        elif func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) and args[0].dtype == torch.float32:
            self.fp32_gemms += 1
        return func(*args, **kwargs)


def products_on_sm90(argv):
    """The child's entry (the CUDA runtime stand-in loaded): each recipe's three products of one layer on
    fake CUDA tensors of an H100 under the rehearsal's rules; prints one JSON object per recipe."""
    import json

    from torch._subclasses.fake_tensor import FakeTensorMode

    from megand.core.tensor_parallel.fp8 import Fp8Policy
    from megand.tools.device_rules import DeviceRules

    results = {}
    for recipe in argv:
        policy = Fp8Policy(recipe=recipe, kernels=Fp8Kernels.for_capability((9, 0)))
        with FakeTensorMode(), torch.no_grad(), DeviceRules(torch.device("cuda", 0)):
            x = torch.empty(64, 128, device="cuda", dtype=torch.bfloat16)
            weight = torch.empty(96, 128, device="cuda", dtype=torch.bfloat16)
            grad = torch.empty(64, 96, device="cuda", dtype=torch.bfloat16)
            main = torch.zeros(96, 128, device="cuda", dtype=torch.float32)
            with _ProductCalls() as calls:
                calls.product = "forward"
                policy.forward(policy.input_operand(x), weight)
                calls.product = "input_grad"
                policy.input_grad(grad, weight)
                calls.product = "weight_grad"
                policy.add_weight_grad(main, grad, x)
        results[recipe] = {"scaled": calls.scaled, "fp32_gemms": calls.fp32_gemms, "ops": calls.ops}
    print("RESULTS " + json.dumps(results))


@pytest.fixture(scope="module")
def sm90_products():
    import json

    from megand.tools import fake_cuda

    proc = fake_cuda.run_child("tests.unit.test_fp8_kernels:products_on_sm90", ["tensorwise", "rowwise"],
                               capture_output=True, text=True, timeout=600)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULTS "):])


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_every_product_of_a_layer_runs_the_fp8_kernel_on_sm90(sm90_products, recipe):
    """On fake CUDA tensors of an H100 (the rehearsal's rules): forward, input gradient and the weight
    gradient added into the fp32 main gradient all reach torch._scaled_mm; the forward with fast
    accumulation, the gradients without. Rowwise weight gradients (an fp32 result asked for, which the
    rowwise kernel does not return) ran as the fp32 emulation before."""
    result = sm90_products[recipe]
    assert result["fp32_gemms"] == 0, result["ops"]
    weight_grad = "torch.float32" if recipe == "tensorwise" else "torch.bfloat16"  # rowwise returns bf16 only
    assert result["scaled"] == [["torch.bfloat16", True], ["torch.bfloat16", False], [weight_grad, False]], result
