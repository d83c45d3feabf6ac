"""The GEMM seam of the parallel linear layers: the weight-gradient pass fuses into the engine's fp32
accumulator also in a compiled backward, can be deferred (a zero-bubble schedule's W pass) and equals the
immediate one, and the accumulating product neither makes a product-sized temporary nor hides errors."""

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from megand.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megand.core.tensor_parallel.wgrad import AccumulatingGemm, DeferredWeightGrads, WeightGradSink
from megand.core.transformer.mlp import SwiGLU, SwiGLUColumnParallelLinear

KINDS = {"column": ColumnParallelLinear, "row": RowParallelLinear, "swiglu": SwiGLUColumnParallelLinear}


@pytest.fixture(autouse=True)
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def layer(kind):
    torch.manual_seed(0)
    module = KINDS[kind](32, 48, tp_group=dist.group.WORLD, bias=True)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    return module


def fake_engine(module):
    """What the data-parallel engine gives the weight: an fp32 accumulator and ``accumulate_grad`` (of the
    engine's sink, ``w.sink``, which a split schedule defers)."""
    w = module.weight
    w.main_grad, w.handed, w.sink = torch.zeros_like(w, dtype=torch.float32), [], WeightGradSink()
    w.accumulate_grad = w.sink.accumulator(lambda add: (w.handed.append(1), add(w.main_grad, False)))
    return w


def reference_grad(kind, x, g):
    module = layer(kind)
    module(x).backward(g)
    return module.weight.grad


@pytest.mark.parametrize("kind", list(KINDS))
def test_compiled_backward_fuses_the_weight_gradient(kind):
    """Compiled, the layers hand their weight gradient to the engine as in eager mode (it used to come back
    as a p.grad through autograd), in one graph (SwiGLU's backward wrote into strided out= views)."""
    torch._dynamo.reset()
    module = layer(kind)
    w = fake_engine(module)
    x, g = torch.randn(8, 2, 32), torch.randn(8, 2, 24 if kind == "swiglu" else 48)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    for _ in range(2):
        compiled(x).backward(g)
    assert w.grad is None and len(w.handed) == 2
    torch.testing.assert_close(w.main_grad, 2 * reference_grad(kind, x, g), rtol=1e-5, atol=1e-4)


def test_swiglu_activation_backward_traces_in_one_graph():
    h = torch.randn(6, 5, 2, requires_grad=True)
    g = torch.randn(6, 5)
    torch._dynamo.reset()
    out = torch.compile(lambda t: SwiGLU.apply(t), fullgraph=True, backend="aot_eager")(h)
    out.backward(g)
    ref = h.detach().clone().requires_grad_()
    (torch.nn.functional.silu(ref[..., 0]) * ref[..., 1]).backward(g)
    torch.testing.assert_close(h.grad, ref.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_swiglu_backward_interleaves_bitwise_as_a_stack(dtype):
    """The eager backward writes the interleaved (gate, up) gradient through a complex view instead of a
    stack (whose stride-2 copies are slow on CPU): the same bits, also from strided inputs."""
    from megand.core.transformer.mlp import _interleave

    pair = torch.randn(6, 5, 2).to(dtype)
    first, second = pair[..., 0], pair[..., 1]  # strided views, as SwiGLU's backward gets them
    assert torch.equal(_interleave(first, second), torch.stack([first, second], dim=-1))
    h = pair.clone().requires_grad_()
    g = torch.randn(6, 5).to(dtype)
    SwiGLU.apply(h).backward(g)
    ref = pair.clone().requires_grad_()
    (torch.nn.functional.silu(ref[..., 0]) * ref[..., 1]).backward(g)
    torch.testing.assert_close(h.grad, ref.grad)


@pytest.mark.parametrize("kind", list(KINDS))
def test_deferred_weight_gradient_pass_equals_the_immediate_one(kind):
    module = layer(kind)
    w = fake_engine(module)
    x = torch.randn(8, 2, 32, requires_grad=True)
    g = torch.randn(8, 2, 24 if kind == "swiglu" else 48)
    with w.sink.deferring(DeferredWeightGrads()) as w_pass:
        module(x).backward(g)  # B: the input gradient only
    assert x.grad is not None and len(w_pass) == 1 and not w.handed and not w.main_grad.any()
    assert w_pass.run() == 1
    torch.testing.assert_close(w.main_grad, reference_grad(kind, x.detach(), g), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", ["column", "swiglu"])
def test_deferred_pass_adds_into_an_accumulator_viewed_without_grad_mode(kind):
    """The engine's ``main_grad`` is a view of its flat buffer made under no_grad; a W pass run by the
    schedule, outside autograd's backward, must still add into it in place (it raised before)."""
    module = layer(kind)
    w = fake_engine(module)
    with torch.no_grad():
        flat = torch.zeros(w.numel(), dtype=torch.float32)
        w.main_grad = flat.view(w.shape)
    x = torch.randn(8, 2, 32, requires_grad=True)
    g = torch.randn(8, 2, 24 if kind == "swiglu" else 48)
    with w.sink.deferring(DeferredWeightGrads()) as w_pass:
        module(x).backward(g)
    assert w_pass.run() == 1  # grad mode is on here, as in the schedule
    torch.testing.assert_close(flat.view(w.shape), reference_grad(kind, x.detach(), g), rtol=1e-5, atol=1e-4)


class Ops(TorchDispatchMode):
    """Records the aten ops (inside FakeTensorMode: fake CUDA tensors on this CPU build). The accumulating
    GEMM has no fake kernel here: it is answered with its in-place result. ``fail_first``: the first GEMM
    raises out of memory."""

    def __init__(self, fail_first=False):
        super().__init__()
        self.seen, self.fail_first = [], fail_first

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if str(func).startswith("aten."):
            self.seen.append(str(func))
        if self.fail_first and "mm" in str(func):
            self.fail_first = False
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        if func is torch.ops.aten.addmm.dtype_out:
            return kwargs["out"]
        return func(*args, **kwargs)


def fake_cuda_operands():
    out = torch.empty(512, 256, device="cuda")  # the weight's fp32 accumulator
    a = torch.empty(512, 64, device="cuda", dtype=torch.bfloat16)
    b = torch.empty(64, 256, device="cuda", dtype=torch.bfloat16)
    return out, a, b


def test_accumulating_gemm_makes_no_weight_sized_temporary():
    gemm = AccumulatingGemm()
    with FakeTensorMode():
        out, a, b = fake_cuda_operands()
        with Ops():
            assert gemm.takes_out_dtype(out, a)  # the one probe (a 2 x 2 product), answered by Ops
        with Ops() as ops:
            gemm(out, a, b)
    assert ops.seen == ["aten.addmm.dtype_out"], ops.seen  # was mm(out_dtype=fp32) into a temporary, then add_


def test_out_of_memory_in_the_weight_gradient_propagates():
    """An OOM used to be caught with every RuntimeError and turned into a silent switch to bf16 products."""
    gemm = AccumulatingGemm()
    with FakeTensorMode():
        out, a, b = fake_cuda_operands()
        with Ops():
            assert gemm.takes_out_dtype(out, a)
        with pytest.raises(torch.OutOfMemoryError), Ops(fail_first=True):
            gemm(out, a, b)


@pytest.mark.parametrize("kind", list(KINDS))
def test_recomputed_layer_still_fuses_its_weight_gradient(kind):
    """Under activation recompute backward unpacks a detached copy of the weight, without the engine's
    accumulate_grad: the fusion used to fall back silently to autograd's p.grad there."""
    module = layer(kind)
    w = fake_engine(module)
    x = torch.randn(8, 2, 32, requires_grad=True)
    g = torch.randn(8, 2, 24 if kind == "swiglu" else 48)
    torch.utils.checkpoint.checkpoint(module, x, use_reentrant=False).backward(g)
    assert w.grad is None and len(w.handed) == 1
    torch.testing.assert_close(w.main_grad, reference_grad(kind, x.detach(), g), rtol=1e-5, atol=1e-4)


def test_fused_grouped_expert_gemm_defers_its_weight_gradient():
    """The experts' fused grouped GEMM (torch._grouped_mm, the CUDA bf16 path; it also runs on CPU in fp32)
    queues its weight gradient like the dense layers and the loop over experts (autograd used to compute
    it during B): nothing reaches the accumulator in B, the W pass adds what autograd's gradient of the
    same kernel is, with an expert of no rows and rows of no expert (masked: zero gradient)."""
    from megand.core.transformer.moe import grouped_linear

    g = torch.Generator().manual_seed(4)
    weight, x = torch.randn(3, 16, 8, generator=g), torch.randn(13, 8, generator=g)
    counts = torch.tensor([5, 0, 6])
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    grad = torch.randn(13, 16, generator=g)
    grad[11:] = 0.0  # the dispatcher masks the rows of no expert
    ref_w, ref_x = weight.clone().requires_grad_(), x.clone().requires_grad_()
    grouped_linear(ref_x, ref_w, counts, offsets, fused=True).backward(grad)  # no engine: autograd's gradient
    w = weight.clone().requires_grad_()
    w.main_grad, w.handed, sink = torch.zeros_like(w), [], WeightGradSink()
    w.accumulate_grad = sink.accumulator(lambda add: (w.handed.append(1), add(w.main_grad, False)))
    xx = x.clone().requires_grad_()
    with sink.deferring(DeferredWeightGrads()) as w_pass:
        grouped_linear(xx, w, counts, offsets, fused=True).backward(grad)  # B
    assert w.grad is None and len(w_pass) == 1 and not w.handed and not w.main_grad.any()
    torch.testing.assert_close(xx.grad, ref_x.grad)
    assert w_pass.run() == 1 and w.handed == [1]
    torch.testing.assert_close(w.main_grad, ref_w.grad)
    loop = weight.clone().requires_grad_()
    grouped_linear(x, loop, counts, offsets, fused=False).backward(grad)
    torch.testing.assert_close(w.main_grad, loop.grad, rtol=1e-5, atol=1e-5)


def test_accumulating_gemm_falls_back_where_the_probe_says_no(monkeypatch):
    """torch 2.8-2.9's CUDA addmm refuses out_dtype=fp32 into an fp32 ``out`` with bf16 operands: where the
    one probe says so, the product runs as an fp32 GEMM of the converted operands (no accumulating
    overload called), and the answer is kept (probed once)."""
    gemm, probes = AccumulatingGemm(), []
    monkeypatch.setattr(gemm, "probe", lambda out, a: probes.append(1) or False)
    with FakeTensorMode():
        out, a, b = fake_cuda_operands()
        with Ops() as ops:
            gemm(out, a, b)
            gemm(out, a, b)
    assert probes == [1] and gemm.takes == {("cuda", torch.bfloat16, torch.float32): False}
    assert "aten.addmm.dtype_out" not in ops.seen and ops.seen.count("aten.addmm_.default") == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the accumulating overload is a CUDA kernel")
def test_accumulating_gemm_fallback_equals_the_accumulating_product():
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(512, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    start = torch.randn(256, 128, device="cuda", generator=g)
    accumulating, fallback = AccumulatingGemm(), AccumulatingGemm()
    fallback.probe = lambda out, a: False
    outs = [start.clone(), start.clone()]
    accumulating(outs[0], a, b)
    fallback(outs[1], a, b)
    assert accumulating.takes_out_dtype(outs[0], a) and not fallback.takes_out_dtype(outs[1], a)
    torch.testing.assert_close(outs[1], outs[0])
