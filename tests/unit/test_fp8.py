"""FP8 recipes: the quantisation of each recipe against a plain-python reference (scales, rounding to
nearest even, saturation), and the products against fp32 within each recipe's expected error."""

import math
import struct

import pytest
import torch
import torch.distributed as dist

from megand.core.tensor_parallel import ColumnParallelLinear
from megand.core.tensor_parallel.fp8 import E4M3, E5M2, Fp8Policy, quantize, scaled_mm, scaled_mm_kernel

FORMATS = {E4M3: (4, 3, 7), E5M2: (5, 2, 15)}  # exponent bits, mantissa bits, bias


def f32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]


def grid(dtype):
    """Every finite non-negative value of the format with its mantissa's last bit (for ties to even)."""
    e_bits, m_bits, bias = FORMATS[dtype]
    values = []
    for e in range(2 ** e_bits):
        for m in range(2 ** m_bits):
            if dtype == E4M3 and e == 15 and m == 7:  # e4m3fn: the one NaN code, no infinities
                continue
            if dtype == E5M2 and e == 31:  # e5m2: infinities and NaNs
                continue
            value = (m / 2 ** m_bits) * 2.0 ** (1 - bias) if e == 0 else (1 + m / 2 ** m_bits) * 2.0 ** (e - bias)
            values.append((value, m & 1))
    return sorted(values)


def round_fp8(v: float, dtype) -> float:
    """Round to nearest, ties to the even mantissa; beyond the largest finite value: saturate to it."""
    values = grid(dtype)
    top = values[-1][0]
    if abs(v) >= top:
        return math.copysign(top, v)
    best = min(values, key=lambda pair: (abs(abs(v) - pair[0]), pair[1]))
    return math.copysign(best[0], v)


def reference(rows, recipe, dtype, dim):
    """(quantised values, scales) of a list-of-lists matrix along ``dim``, in plain python."""
    top = grid(dtype)[-1][0]
    n_rows, n_cols = len(rows), len(rows[0])
    lines = [[rows[i][j] for j in range(n_cols)] for i in range(n_rows)] if dim == 1 else \
        [[rows[i][j] for i in range(n_rows)] for j in range(n_cols)]
    if recipe == "tensorwise":
        scales = {0: f32(max(abs(v) for line in lines for v in line) / top)}
        group_of = {(i, j): 0 for i in range(len(lines)) for j in range(len(lines[0]))}
    elif recipe == "rowwise":
        scales = {i: f32(max(abs(v) for v in line) / top) for i, line in enumerate(lines)}
        group_of = {(i, j): i for i in range(len(lines)) for j in range(len(lines[0]))}
    else:  # mxfp8: blocks of 32 along the line
        emax = {E4M3: 8, E5M2: 15}[dtype]
        scales, group_of = {}, {}
        for i, line in enumerate(lines):
            for b in range(0, len(line), 32):
                amax = max(abs(v) for v in line[b:b + 32])
                exponent = math.frexp(amax)[1] - 1 - emax if amax > 0 else -127
                scales[(i, b // 32)] = 2.0 ** max(-127, min(127, exponent))
                for j in range(b, min(b + 32, len(line))):
                    group_of[(i, j)] = (i, b // 32)
    q = [[round_fp8(f32(v / scales[group_of[(i, j)]]), dtype) for j, v in enumerate(line)] for i, line in enumerate(lines)]
    if dim == 0:
        q = [list(col) for col in zip(*q)]
    return q, scales


def sample(rows, cols, seed):
    """Normal values with outliers (a spread of magnitudes across rows and blocks) and a few exact ties."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, cols, generator=g) * torch.logspace(-2, 2, rows).unsqueeze(1)
    t[0, :4] = torch.tensor([0.0, -0.0, 1e-30, -3.0e4])  # zero, tiny, large
    return t


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "mxfp8"])
@pytest.mark.parametrize("dim", [0, 1])
def test_quantisation_matches_the_python_reference(recipe, dtype, dim):
    t = sample(6, 70, seed=3) if dim == 1 else sample(70, 6, seed=3)  # 70: an MX block of 6 at the end
    q = quantize(t, recipe, dtype, dim)
    expected, scales = reference(t.tolist(), recipe, dtype, dim)
    assert q.data.dtype == dtype
    assert q.data.float().tolist() == expected
    got_scales = q.scale.flatten().tolist()
    assert sorted(got_scales) == sorted(scales.values())
    if recipe == "mxfp8":  # e8m0: powers of two
        assert all(math.frexp(s)[0] == 0.5 for s in got_scales)


def test_rounding_is_to_nearest_even_and_saturates():
    # scale 1: tensorwise amax 448 (e4m3's largest). Ties go to the even mantissa: 17 (between 16 and 18)
    # to 16, 19 to 20, and -1.5 * 2^-9 (between the subnormals 2^-9 and 2 * 2^-9) to -2 * 2^-9; 1e-4 (under
    # half the smallest subnormal) to 0
    t = torch.tensor([[448.0, 17.0, 19.0, -1.5 * 2 ** -9, 1.0e-4]])
    q = quantize(t, "tensorwise", E4M3, 1)
    assert q.scale.item() == 1.0
    assert q.data.float().tolist() == [[448.0, 16.0, 20.0, -2 * 2 ** -9, 0.0]]
    # MX: amax 500 -> scale 2^(8-8) = 1, and 500 > 448 saturates (no NaN, no infinity)
    q = quantize(torch.tensor([[500.0, -480.0, 1.0]]), "mxfp8", E4M3, 1)
    assert q.scale.item() == 1.0 and q.data.float().tolist() == [[448.0, -448.0, 1.0]]


def relative(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# the product's relative (Frobenius) error: e4m3's unit roundoff is 2^-4, e5m2's 2^-3 (random errors
# partly cancel in the sums)
BOUNDS = {(E4M3, E4M3): 0.06, (E5M2, E4M3): 0.1}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "mxfp8"])
@pytest.mark.parametrize("a_dtype", [E4M3, E5M2])
def test_products_are_within_the_recipes_error_of_fp32(recipe, a_dtype):
    torch.manual_seed(0)
    a, b = torch.randn(48, 128), torch.randn(128, 64)
    qa, qb = quantize(a, recipe, a_dtype, 1), quantize(b, recipe, E4M3, 0)
    for out_dtype in (torch.float32, torch.bfloat16):
        out = scaled_mm(qa, qb, out_dtype)
        assert out.dtype == out_dtype
        error = relative(out, a @ b)
        assert 0.005 < error < BOUNDS[(a_dtype, E4M3)], (recipe, out_dtype, error)
        if recipe == "mxfp8" or (recipe == "rowwise" and out_dtype == torch.float32):
            continue  # not a call the CUDA kernels take: emulated there too
        # the CUDA path's call (torch._scaled_mm, a reference kernel on CPU) equals the emulation
        kernel = scaled_mm_kernel(qa, qb, out_dtype)
        assert relative(kernel, out) < (1e-6 if out_dtype == torch.float32 else 4e-3)


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "mxfp8"])
def test_linear_layer_in_fp8_tracks_the_bf16_layer(recipe, one_rank):
    """Forward, input and weight gradients of a bf16 layer under each recipe against the fp32 values."""
    torch.manual_seed(0)
    layer = ColumnParallelLinear(64, 96, tp_group=dist.group.WORLD, bias=True, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(std=0.1)
    layer.set_gemm(Fp8Policy(recipe=recipe))
    x = torch.randn(16, 2, 64).bfloat16().requires_grad_()
    g = torch.randn(16, 2, 96).bfloat16()
    out = layer(x)
    out.backward(g)
    assert out.dtype == torch.bfloat16 and layer.weight.grad.dtype == torch.bfloat16
    x32, w32 = x.detach().float().requires_grad_(), layer.weight.detach().float().requires_grad_()
    ref = torch.nn.functional.linear(x32, w32, layer.bias.detach().float())
    ref.backward(g.float())
    assert relative(out, ref) < 0.06
    assert relative(x.grad, x32.grad) < 0.1
    assert relative(layer.weight.grad, w32.grad) < 0.1
    # recomputation quantises identically: a second forward is bit-equal
    assert torch.equal(layer(x).detach(), out.detach())


def test_config_refuses_fp8_without_bf16_in_one_line():
    from megand.training.config import ConfigError, compose, validate

    with pytest.raises(ConfigError, match=r"^train.fp8=tensorwise needs train.precision=bf16 \(got fp32\)$"):
        validate(compose(["+experiment=tiny_llama", "train.fp8=tensorwise"]), 1)
    with pytest.raises(ConfigError, match=r"train.fp8='fp4'"):
        validate(compose(["+experiment=tiny_llama", "train.precision=bf16", "train.fp8=fp4"]), 1)
    validate(compose(["+experiment=tiny_llama", "train.precision=bf16", "train.fp8=mxfp8"]), 1)


def test_mfu_counts_fp8_gemms_at_the_fp8_peak():
    from megand.models.flops import forward_flops_per_token, fp8_flops_fraction
    from megand.training.peak import gpu_peak_flops, mixed_peak

    model = {"arch": "llama", "num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 176, "num_attention_heads": 4,
             "num_query_groups": 2, "seq_length": 32, "vocab_size": 251, "activation": "swiglu",
             "position_embedding": "rope", "tie_embeddings": False}
    fwd = forward_flops_per_token(model)
    assert fp8_flops_fraction(model, 0) == 0.0
    assert fp8_flops_fraction(model, 2) == pytest.approx(2 * fwd.layer_dense / fwd.total)
    bf16, fp8 = gpu_peak_flops("NVIDIA H100 80GB HBM3", "bf16"), gpu_peak_flops("NVIDIA H100 80GB HBM3", "fp8")
    assert fp8 == pytest.approx(2 * bf16, rel=1e-3) and gpu_peak_flops("NVIDIA A100-SXM4-80GB", "fp8") is None
    assert mixed_peak(bf16, fp8, 0.0) == bf16 and mixed_peak(bf16, None, 0.5) == bf16
    assert mixed_peak(bf16, fp8, 1.0) == pytest.approx(fp8)
    assert bf16 < mixed_peak(bf16, fp8, 0.5) < fp8


def test_use_fp8_keeps_the_first_and_last_layers_in_bf16(one_rank):
    from megand.core.checkpointing.offline import single_process_topology
    from megand.core.tensor_parallel.fp8 import use_fp8
    from megand.core.transformer import TransformerConfig
    from megand.models.gpt import GPTModel

    cfg = TransformerConfig(num_layers=4, precision="bf16", num_experts=4, moe_layer_freq=2)
    topo = single_process_topology()
    model = GPTModel(cfg, topo, None, device=torch.device("meta"))
    assert use_fp8(model.layers, "rowwise", 4, 1) == [1, 2]
    names = {name: type(m.gemm).__name__ for name, m in model.named_modules() if hasattr(m, "gemm")}
    assert names and all((kind == "Fp8Policy") == (name.startswith(("layers.1.", "layers.2."))) for name, kind in names.items())
    assert any(".experts." in name and kind == "Fp8Policy" for name, kind in names.items())  # layer 2: MoE


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_quantisation_is_bitwise_the_plain_formula(recipe, src_dtype):
    """The two-pass quantiser (amax, then the scaled cast) gives the bytes and scales of the plain formula
    on CPU: the same arithmetic, reordered only where it is exact (|t| and its max
    taken before widening to fp32)."""
    torch.manual_seed(0)
    t = (torch.randn(48, 80) * 3).to(src_dtype)
    for dim in (0, 1):
        for dtype in (E4M3, E5M2):
            src = t.float()
            amax = src.abs().amax() if recipe == "tensorwise" else src.abs().amax(dim=dim, keepdim=True)
            scale = amax.clamp(min=1e-12) / torch.finfo(dtype).max
            data = (src / scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype)
            q = quantize(t, recipe, dtype, dim)
            assert torch.equal(q.scale, scale)
            assert torch.equal(q.data.view(torch.uint8), data.view(torch.uint8))


def _counting_casts(monkeypatch):
    from megand.core.tensor_parallel.fp8_recipes import scaling

    casts, cast = [], scaling._cast
    monkeypatch.setattr(scaling, "_cast", lambda t, *args: casts.append(tuple(t.shape)) or cast(t, *args))
    return casts


def test_tensorwise_weights_are_quantised_once_per_step_until_explicitly_dropped(monkeypatch, one_rank):
    """Inside ``weights_cached`` a tensorwise layer quantises its weight once for every micro-batch's forward
    and input gradient (the output gradient once for both gradients), with the products bit-identical to
    quantising at each use; the cache ends with the block: a weight changed inside it is not seen (the
    optimizer steps outside), the next block quantises the new values."""
    from megand.core.tensor_parallel.fp8 import weights_cached

    torch.manual_seed(0)
    layer = ColumnParallelLinear(64, 96, tp_group=dist.group.WORLD, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.normal_(std=0.1)
    layer.set_gemm(Fp8Policy(recipe="tensorwise"))
    xs = [torch.randn(8, 2, 64).bfloat16().requires_grad_() for _ in range(3)]
    g = torch.randn(8, 2, 96).bfloat16()

    def step():
        outs, grads = [], []
        for x in xs:
            out = layer(x)
            out.backward(g)
            outs.append(out.detach())
            grads.append(x.grad)
            x.grad = None
        return outs, grads

    casts = _counting_casts(monkeypatch)
    plain = step()
    weight_casts = casts.count((96, 64))
    assert weight_casts == 6 and casts.count((16, 96)) == 3  # per micro-batch: forward and input gradient
    casts.clear()
    with weights_cached([layer]):
        cached = step()
        assert casts.count((96, 64)) == 1 and casts.count((16, 96)) == 3, casts
        with torch.no_grad():
            layer.weight.mul_(2)
        stale, _ = step()
    assert all(torch.equal(a, b) for a, b in zip(plain[0] + plain[1], cached[0] + cached[1]))
    assert all(torch.equal(a, b) for a, b in zip(plain[0], stale))  # not seen inside the block
    with weights_cached([layer]):
        fresh, _ = step()
    assert layer.gemm.cache is None
    assert all(torch.equal(a, 2 * b) for a, b in zip(fresh, plain[0]))  # the doubled weight, quantised anew
