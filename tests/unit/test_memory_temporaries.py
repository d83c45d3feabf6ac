"""Temporaries and saved tensors that scale with the model: measured on CPU by recording the sizes of
what each op allocates (a dispatch mode) and what autograd saves for backward."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megand.core.optimizer import grad_norm
from megand.core.transformer.moe import LocalDispatcher


class Allocations(TorchDispatchMode):
    """Records the bytes of every tensor an op returns in new storage (views of an input are not new)."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in _tensors(args) if t.device.type != "meta"}
        for t in _tensors([out]):
            if t.device.type != "meta" and t.untyped_storage().data_ptr() not in inputs:
                self.sizes.append(t.numel() * t.element_size())
        return out


def _tensors(values):
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _tensors(v)


def test_grad_norm_squares_a_piece_at_a_time(monkeypatch):
    monkeypatch.setattr(grad_norm, "SQUARES_CHUNK", 4096, raising=False)
    torch.manual_seed(0)
    big, small = torch.randn(5 * 4096 + 17), torch.randn(100)
    bf16 = torch.randn(5 * 4096 + 17).bfloat16()  # converted to fp32 a piece at a time, not whole
    with Allocations() as allocations:
        sums = grad_norm._sums_of_squares([big, small, bf16])
    assert max(allocations.sizes) <= 4096 * 4, max(allocations.sizes)  # one piece in fp32
    expected = torch.stack([x.double().square().sum() for x in (big, small, bf16)]).float()
    torch.testing.assert_close(sums, expected, rtol=1e-6, atol=0)


def test_moe_combine_saves_no_fp32_copy_of_the_expert_outputs():
    """bf16 expert outputs ``[T*k, h]``: backward keeps them in bf16, not an fp32 copy (twice the bytes)."""
    t, k, h = 32, 2, 64
    torch.manual_seed(0)
    outputs = torch.randn(t * k, h, dtype=torch.bfloat16, requires_grad=True)
    weights = torch.rand(t, k, requires_grad=True)
    order = torch.randperm(t * k)
    saved = []

    def pack(x):
        saved.append(x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = LocalDispatcher(4).unpermute(outputs, order, weights, None)
    fp32_big = [tuple(x.shape) for x in saved if x.dtype == torch.float32 and x.numel() >= t * k * h]
    assert not fp32_big, fp32_big
    # the same values and gradients as the plain expression
    grad = torch.randn(t, h, dtype=torch.bfloat16)
    out.backward(grad)
    got = outputs.grad.clone(), weights.grad.clone()
    outputs.grad = weights.grad = None
    back = torch.empty_like(outputs)
    back[order] = outputs
    reference = (back.view(t, k, -1).float() * weights.unsqueeze(-1)).sum(1).to(outputs.dtype)
    reference.backward(grad)
    assert torch.equal(out, reference)
    assert torch.equal(got[0], outputs.grad) and torch.equal(got[1], weights.grad)
