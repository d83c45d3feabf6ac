"""SwiGLU stores only its input (the fc1 output) for backward, with the gradients of the plain expression."""

import torch
import torch.nn.functional as F

from megand.core.transformer.mlp import SwiGLU


def test_gradient_equals_autograd_of_the_expression():
    torch.manual_seed(0)
    h = torch.randn(5, 3, 7, 2, dtype=torch.float64)
    grad = torch.randn(5, 3, 7, dtype=torch.float64)
    mine, ref = h.clone().requires_grad_(), h.clone().requires_grad_()
    out = SwiGLU.apply(mine)
    expected = F.silu(ref[..., 0]) * ref[..., 1]
    torch.testing.assert_close(out, expected)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(mine.grad, ref.grad)


def test_only_the_input_is_saved():
    saved = {}

    def pack(t):
        saved[id(t.untyped_storage())] = t.untyped_storage().nbytes()
        return t

    h = torch.randn(16, 2, 64, 2, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        SwiGLU.apply(h)
    assert sum(saved.values()) == h.nbytes
