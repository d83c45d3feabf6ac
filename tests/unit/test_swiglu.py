"""The SwiGLU fc1 (two GEMMs on the interleaved fused weight, silu on contiguous halves) has the values and
gradients of the plain expression, and stores only its input, the gate and the up product for backward."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megand.core.transformer.mlp import SwiGLULinear, fuse_swiglu, split_swiglu


def _expression(x, weight, bias):
    gate, up = split_swiglu(weight)
    b_gate, b_up = split_swiglu(bias) if bias is not None else (None, None)
    return F.silu(F.linear(x, gate, b_gate)) * F.linear(x, up, b_up)


def test_values_and_gradients_equal_the_expression():
    torch.manual_seed(0)
    for with_bias in (False, True):
        x = torch.randn(5, 3, 8, dtype=torch.float64)
        weight = fuse_swiglu(torch.randn(7, 8, dtype=torch.float64), torch.randn(7, 8, dtype=torch.float64))
        bias = torch.randn(14, dtype=torch.float64) if with_bias else None
        grad = torch.randn(5, 3, 7, dtype=torch.float64)
        mine = [t.clone().requires_grad_() if t is not None else None for t in (x, weight, bias)]
        ref = [t.clone().requires_grad_() if t is not None else None for t in (x, weight, bias)]
        out = SwiGLULinear.apply(*mine, None, False)
        expected = _expression(*ref)
        torch.testing.assert_close(out, expected)
        out.backward(grad)
        expected.backward(grad)
        for a, b in zip(mine, ref):
            if a is not None:
                torch.testing.assert_close(a.grad, b.grad)


def test_only_input_gate_and_up_are_saved():
    saved = {}

    def pack(t):
        saved[id(t.untyped_storage())] = t.untyped_storage().nbytes()
        return t

    x = torch.randn(16, 2, 32, requires_grad=True)
    weight = torch.randn(2 * 64, 32, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        SwiGLULinear.apply(x, weight, None, None, False)
    activations = sum(saved.values()) - weight.nbytes  # the parameter itself costs nothing extra
    assert activations == x.nbytes + 2 * (16 * 2 * 64 * 4)  # input, gate, up
