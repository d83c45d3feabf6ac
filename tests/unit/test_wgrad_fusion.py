"""The parallel linear layers add their weight gradients straight into the data-parallel engine's fp32
accumulator: in a bf16 model no bf16 weight gradient is made, and the micro-batches' products are summed
at fp32 instead of each being rounded to bf16 first."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megand.core.distributed import DataParallel, DataParallelConfig, last_backward
from megand.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megand.core.transformer.mlp import SwiGLUColumnParallelLinear

MICRO_BATCHES = 4


@pytest.fixture(autouse=True)
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def topo():
    world = dist.group.WORLD
    return SimpleNamespace(dp_cp_group=world, dp_cp_size=1, dp_cp_rank=0, dp_shard_group=world, dp_shard_size=1,
                           dp_shard_rank=0, dp_replica_group=None, dp_replica_size=1, dp_replica_rank=0, tp_size=1,
                           pp_size=1, world_size=1, device=torch.device("cpu"))


def layer(kind, dtype):
    torch.manual_seed(0)
    make = {"column": ColumnParallelLinear, "row": RowParallelLinear, "swiglu": SwiGLUColumnParallelLinear}[kind]
    module = make(64, 96, tp_group=dist.group.WORLD, bias=True, dtype=dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    return module


def weight_grad_hooks(module):
    """Counts the weight gradients autograd computes as tensors (before any accumulation)."""
    made = []
    module.weight.register_hook(lambda g: made.append(g.dtype) if g is not None else None)
    return made


@pytest.mark.parametrize("sharding", ["none", "optim_grads"])
@pytest.mark.parametrize("kind", ["column", "row"])
def test_bf16_weight_gradient_is_summed_at_fp32(kind, sharding):
    module = layer(kind, torch.bfloat16)
    engine = DataParallel([module], topo(), DataParallelConfig(sharding=sharding))
    made = weight_grad_hooks(module)
    torch.manual_seed(1)
    xs = torch.randn(MICRO_BATCHES, 16, 2, 64).bfloat16()
    gs = torch.randn(MICRO_BATCHES, 16, 2, 96).bfloat16()  # each micro-batch's output gradient
    for i, (x, g) in enumerate(zip(xs, gs)):
        with last_backward(engine if i == MICRO_BATCHES - 1 else None):
            module(x).backward(g)
    engine.finish_grad_sync()
    main = dict(engine.grad_pieces())[module.weight].view(96, 64)  # one rank: its piece is the whole
    # the exact sum of the bf16 products, in float64
    exact = sum(g.double().reshape(-1, 96).t() @ x.double().reshape(-1, 64) for x, g in zip(xs, gs))
    relative = ((main.double() - exact).norm() / exact.norm()).item()
    assert relative < 1e-6, relative  # each product rounded to bf16 first: about 1e-3
    assert main.dtype == torch.float32 and made == []
    assert module.weight.grad is None


@pytest.mark.parametrize("sharding", ["none", "optim_grads"])
def test_swiglu_fc1_adds_the_gradients_of_its_gate_and_up_rows(sharding):
    module, reference = layer("swiglu", torch.float32), layer("swiglu", torch.float32)
    engine = DataParallel([module], topo(), DataParallelConfig(sharding=sharding))
    made = weight_grad_hooks(module)
    torch.manual_seed(1)
    xs, gs = torch.randn(MICRO_BATCHES, 16, 2, 64), torch.randn(MICRO_BATCHES, 16, 2, 48)
    for i, (x, g) in enumerate(zip(xs, gs)):
        with last_backward(engine if i == MICRO_BATCHES - 1 else None):
            module(x).backward(g)
        reference(x).backward(g)  # no engine: autograd's p.grad, summed by autograd
    engine.finish_grad_sync()
    grads = {p: g.view(p.shape) for p, g in engine.grad_pieces()}  # one rank: its pieces are whole
    assert made == []
    torch.testing.assert_close(grads[module.weight], reference.weight.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[module.bias], reference.bias.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sharding", ["none", "optim", "optim_grads"])
def test_a_step_gradient_is_its_own_and_a_parameter_without_one_reads_zero(sharding):
    """Unsharded gradients are not zeroed between steps: each parameter's first gradient of a step is written
    over what the buffer held (NaN here), the later micro-batches' added; a parameter that receives none reads
    zero after finish_grad_sync. Weights (fused GEMM, beta 0) and biases (autograd's gradient, copied) alike."""
    used, unused = layer("column", torch.float32), layer("row", torch.float32)
    engine = DataParallel([torch.nn.ModuleList([used, unused])], topo(), DataParallelConfig(sharding=sharding))
    torch.manual_seed(1)
    for module in (used, unused):  # step 1: both receive gradients
        module(torch.randn(16, 2, 64)).sum().backward()
    engine.finish_grad_sync()
    engine.zero_grad()
    if sharding != "optim_grads":
        assert all(p.main_grad.abs().sum() > 0 for p in engine.params)  # zero_grad wrote nothing
        for p in engine.params:
            p.main_grad.fill_(float("nan"))
    xs, gs = torch.randn(2, 16, 2, 64), torch.randn(2, 16, 2, 96)
    for i, (x, g) in enumerate(zip(xs, gs)):  # step 2: two micro-batches, the row layer unused
        with last_backward(engine if i == 1 else None):
            used(x).backward(g)
    engine.finish_grad_sync()
    pieces = dict(engine.grad_pieces())
    exact = sum(g.double().reshape(-1, 96).t() @ x.double().reshape(-1, 64) for x, g in zip(xs, gs))
    torch.testing.assert_close(pieces[used.weight].view(96, 64).double(), exact, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(pieces[used.bias].double(), gs.double().sum((0, 1, 2)), rtol=1e-6, atol=1e-5)
    for p in unused.parameters():
        assert torch.equal(pieces[p], torch.zeros_like(pieces[p]))
