"""The routed experts in FP8 (megand/core/tensor_parallel/fp8_grouped.py): each expert's operands quantised
on their own exactly as the dense recipe quantises that expert's rows (vectorised, with an expert of no
rows and rows of no expert); the CUDA kernels' calls (torch._scaled_grouped_mm, the bf16 grouped GEMM of
the weight gradient) against the emulation where torch runs them on CPU, and CUDA's argument rules the
rehearsal enforces on them; the weight gradient deferred into a zero-bubble W pass."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megand.core.tensor_parallel.fp8 import E4M3, Fp8Policy
from megand.core.tensor_parallel.fp8_grouped import GroupedFp8, GroupedFp8Linear, GroupedOperands, weight_sums
from megand.core.tensor_parallel.wgrad import DeferredWeightGrads, WeightGradSink

E, N, K = 3, 16, 32
COUNTS = [5, 0, 6]  # then 2 rows of no expert
ROWS = sum(COUNTS) + 2


def operands(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(E, N, K, generator=g).to(dtype)
    x = torch.randn(ROWS, K, generator=g).to(dtype)
    dy = torch.randn(ROWS, N, generator=g).to(dtype)
    dy[sum(COUNTS):] = 0  # the dispatcher masks the rows of no expert
    return w, x, dy, torch.cumsum(torch.tensor(COUNTS), 0).to(torch.int32)


def per_expert_reference(recipe, w, x, dy):
    """Each expert's products through the dense recipe (e4m3 gradients, as the grouped kernel takes)."""
    policy = Fp8Policy(recipe=recipe)
    policy.grad_dtype = E4M3
    bounds = torch.cumsum(torch.tensor([0] + COUNTS), 0).tolist()
    out, grad_x, grad_w = [], [], []
    for e in range(E):
        xs, gs = x[bounds[e]:bounds[e + 1]], dy[bounds[e]:bounds[e + 1]]
        if len(xs) == 0:
            grad_w.append(w.new_zeros(N, K))
            continue
        out.append(policy.forward(xs, w[e]))
        grad_x.append(policy.input_grad(gs, w[e]))
        grad_w.append(policy.weight_grad(gs, xs))
    tail = ROWS - bounds[-1]
    return (torch.cat(out + [x.new_zeros(tail, N)]), torch.cat(grad_x + [x.new_zeros(tail, K)]),
            torch.stack(grad_w))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "mxfp8"])
def test_each_expert_is_quantised_as_the_dense_recipe_quantises_its_rows(recipe):
    """The vectorised scales (per row, per expert, per expert column) equal the dense recipe's on each
    expert's rows: forward and input gradient exactly, the weight gradient to fp32 rounding (its sums of
    FP8 values are scaled afterwards). An expert with no rows used to fail (amax of an empty tensor)."""
    w, x, dy, offsets = operands()
    ref_out, ref_x, ref_w = per_expert_reference(recipe, w, x, dy)
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = GroupedFp8Linear.apply(xx, ww, None, offsets, Fp8Policy(recipe=recipe), None)
    out.backward(dy)
    assert torch.equal(out, ref_out) and torch.equal(xx.grad, ref_x)
    torch.testing.assert_close(ww.grad, ref_w, rtol=1e-6, atol=1e-5)


def test_weight_gradient_is_deferred_into_the_w_pass():
    w, x, dy, offsets = operands()
    policy = Fp8Policy(recipe="rowwise")
    ref = w.clone().requires_grad_()
    GroupedFp8Linear.apply(x, ref, None, offsets, policy, None).backward(dy)
    main, handed, sink = torch.zeros_like(w), [], WeightGradSink()
    with sink.deferring(DeferredWeightGrads()) as w_pass:
        ww = w.clone().requires_grad_()
        accumulate = sink.accumulator(lambda add: (handed.append(1), add(main, False)))
        GroupedFp8Linear.apply(x, ww, None, offsets, policy, accumulate).backward(dy)
    assert ww.grad is None and len(w_pass) == 1 and not handed  # B ran without it (it used to run there)
    w_pass.run()
    assert handed == [1] and torch.equal(main, ref.grad)


def test_weight_gradient_kernel_form_equals_the_emulation_on_cpu():
    """The CUDA path's weight-gradient GEMM (torch's bf16 grouped GEMM on the FP8 values, which also runs
    on CPU) against the fp32 sums, within its one bf16 rounding; rows of no expert left out."""
    w, x, dy, offsets = operands()
    dy[sum(COUNTS):] = 3.0  # not masked here: the kernel form must still leave them out
    products = GroupedFp8(Fp8Policy(recipe="rowwise"), offsets, ROWS, E)
    qg, _ = products.tokens_by_column(dy, "mn")
    qx, _ = products.tokens_by_column(x, "mk")
    emulated = weight_sums(qg, qx, products.groups, kernel=False)
    kernel = weight_sums(qg, qx, products.groups, kernel=True)
    torch.testing.assert_close(kernel, emulated, rtol=2 ** -8, atol=0)


def test_device_rules_refuse_what_the_fp8_grouped_kernel_refuses():
    """The rehearsal's rules for torch._scaled_grouped_mm and the grouped weight-gradient layout, on fake
    CUDA tensors (made with their strides: views need the CUDA runtime stand-in of the rehearsal's child,
    where tests/unit/test_rehearse_cuda.py plays the FP8 experts' real calls)."""
    from megand.tools.device_rules import DeviceRules, RehearsalError

    def cuda(shape, stride=None, dtype=torch.float32):
        stride = stride or torch.empty(shape, device="meta").stride()
        return torch.empty_strided(shape, stride, device="cuda:0", dtype=dtype)

    with FakeTensorMode(allow_non_fake_inputs=True), DeviceRules(torch.device("cuda", 0)):
        a = cuda((64, 32), dtype=E4M3)
        b = cuda((E, 32, N), (32 * N, 1, 32), dtype=E4M3)  # column-major [k, n] per expert
        sa, sb = cuda((64,)), cuda((E, N))
        offs = cuda((E,), dtype=torch.int32)
        torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16)
        with pytest.raises(RehearsalError, match="column-major second"):
            torch._scaled_grouped_mm(a, cuda((E, 32, N), dtype=E4M3), sa, sb, offs=offs, out_dtype=torch.bfloat16)
        with pytest.raises(RehearsalError, match="e4m3 operands"):
            torch._scaled_grouped_mm(cuda((64, 32), dtype=torch.float8_e5m2), b, sa, sb, offs=offs,
                                     out_dtype=torch.bfloat16)
        with pytest.raises(RehearsalError, match="fp32 scales"):
            torch._scaled_grouped_mm(a, b, sa, cuda((E, 32)), offs=offs, out_dtype=torch.bfloat16)
        with pytest.raises(RehearsalError, match="positive multiple of 16"):
            torch._scaled_grouped_mm(cuda((32, 64), dtype=E4M3), cuda((64, 32), (1, 64), dtype=E4M3), cuda((32 * E,)),
                                     cuda((32 * E,)), offs=offs, out_dtype=torch.bfloat16)
        g_t = cuda((N, 64), (1, N), dtype=torch.bfloat16)  # dy^T column-major
        x = cuda((64, 32), dtype=torch.bfloat16)
        torch._grouped_mm(g_t, x, offs=offs)
        with pytest.raises(RehearsalError, match="column-major first"):  # dy^T row-major: group sizes asserted
            torch._grouped_mm(cuda((N, 64), dtype=torch.bfloat16), x, offs=offs)


def test_rows_map_to_their_expert():
    groups = GroupedOperands(torch.tensor([2, 2, 5], dtype=torch.int32), 7, 3)
    assert groups.group.tolist() == [0, 0, 2, 2, 2, 3, 3] and groups.kernel_offsets.tolist() == [2, 2, 7]
