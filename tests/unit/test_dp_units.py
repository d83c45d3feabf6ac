"""Single-process pieces of the data-parallel engine and the optimizer (no process group needed at size 1)."""

import copy
from types import SimpleNamespace

import pytest
import torch

from megand.core.distributed import DataParallel, DataParallelConfig, last_backward
from megand.core.distributed.buffers import bucket_layout
from megand.core.optimizer import DynamicLossScaler, Optimizer, OptimizerConfig
from megand.core.sharding import ParamMeta, tag


def test_bucket_layout_padding_and_own_buckets():
    offsets, buckets = bucket_layout([5, 3, 4, 6], bucket_size=7, pad_to=3)
    assert offsets == [0, 5, 9, 13]
    assert buckets == [(0, 9, [0, 1]), (9, 21, [2, 3])]
    offsets, buckets = bucket_layout([5, 3, 4], bucket_size=100, pad_to=2, own_bucket={1})
    assert buckets == [(0, 6, [0]), (6, 10, [1]), (10, 14, [2])] and offsets == [0, 6, 10]
    assert bucket_layout([5, 3], bucket_size=100)[1] == [(0, 8, [0, 1])]


def test_dynamic_loss_scaler_hysteresis_backoff_growth():
    s = DynamicLossScaler(1024.0, min_scale=256.0, growth_interval=3, hysteresis=2)
    s.update(True)
    assert s.scale == 1024.0  # the first overflow is absorbed by hysteresis
    s.update(True)
    assert s.scale == 512.0
    s.update(True)
    assert s.scale == 256.0
    s.update(True)
    assert s.scale == 256.0  # floor
    for _ in range(3):
        s.update(False)
    assert s.scale == 512.0 and s.hysteresis_tracker == 2
    restored = DynamicLossScaler(1.0)
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == s.state_dict()


def _topo():
    return SimpleNamespace(dp_cp_group=None, dp_cp_size=1, dp_cp_rank=0, tp_size=1, pp_size=1, world_size=1,
                           device=torch.device("cpu"))


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(dtype)
    for p in model.parameters():
        tag(p, ParamMeta(tuple(p.shape)))
    return model


@pytest.mark.parametrize("clip_grad", [0.5, 0.01])  # 0.01: every step clips (the fused kernel scales as it reads)
def test_adamw_on_buffers_matches_torch_adamw(clip_grad):
    cfg = OptimizerConfig(lr=1e-2, min_lr=1e-2, warmup_iters=0, schedule="constant", weight_decay=0.1,
                          clip_grad=clip_grad)
    ours, ref = _model(), _model()
    ddp = DataParallel([ours], _topo(), DataParallelConfig(bucket_size=50))
    assert len(ddp.buckets) > 1
    opt = Optimizer(list(ours.named_parameters()), cfg, _topo(), ddp)
    decay = [p for p in ref.parameters() if p.ndim >= 2]
    rest = [p for p in ref.parameters() if p.ndim < 2]
    torch_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=1e-2, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    data = torch.randn(3, 2, 5, 8)  # 3 steps x 2 micro-batches
    for xs in data:
        opt.zero_grad()
        torch_opt.zero_grad()
        for i, x in enumerate(xs):
            with last_backward(ddp) if i == len(xs) - 1 else last_backward(None):
                ours(x).pow(2).mean().backward()
            ref(x).pow(2).mean().backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.clip_grad)
        result = opt.step()
        torch_opt.step()
        assert result.grad_norm == pytest.approx(norm.item(), rel=1e-6)
        assert clip_grad > 0.1 or result.grad_norm > clip_grad
        for p, q in zip(ours.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
            assert p.grad is None
    states = {s.name: s for s in opt.sharded_state_dict()}  # one process: every shard is a whole parameter
    for (name, q) in ref.named_parameters():
        assert "main" not in states[name].tensors  # fp32: the parameter is its own master copy
        torch.testing.assert_close(states[name].tensors["exp_avg"].view(q.shape), torch_opt.state[q]["exp_avg"],
                                   rtol=1e-6, atol=1e-9)


def test_bf16_params_keep_fp32_main_params_and_grads():
    cfg = OptimizerConfig(lr=1e-3, warmup_iters=0, schedule="constant")
    model = _model(torch.bfloat16)
    before = copy.deepcopy(model)
    opt = Optimizer(list(model.named_parameters()), cfg, _topo())  # builds its own engine
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    opt.zero_grad()
    model(x).float().pow(2).mean().backward()
    assert all(p.main_grad.dtype == torch.float32 and p.grad is None for p in model.parameters())
    opt.step()
    states = {s.name: s.tensors for s in opt.sharded_state_dict()}
    for (name, p), q in zip(model.named_parameters(), before.parameters()):
        assert p.dtype == torch.bfloat16 and not torch.equal(p, q)
        assert states[name]["main"].dtype == torch.float32
        assert torch.equal(states[name]["main"].view(p.shape).to(torch.bfloat16), p)  # params: the rounded main params


def test_two_backwards_inside_last_backward_is_an_error():
    model = _model()
    ddp = DataParallel([model], _topo(), DataParallelConfig(overlap_grad_reduce=True, bucket_size=10**6))
    with last_backward(ddp):
        model(torch.randn(2, 8)).sum().backward()
        with pytest.raises(RuntimeError, match="after its bucket was reduced"):
            model(torch.randn(2, 8)).sum().backward()


def test_counted_contributions_make_a_bucket_final_once_and_refuse_one_more():
    """A split schedule's engine: each parameter's m-th gradient (in whatever pass it arrives) completes
    the bucket, which is reduced then, not before; a further gradient is an error, not a second sum."""
    model = _model()
    ddp = DataParallel([model], _topo(), DataParallelConfig(overlap_grad_reduce=True, bucket_size=10**6))
    ddp.expect_contributions(2)
    model(torch.randn(2, 8)).sum().backward()
    assert not ddp._launched  # one of two gradients: nothing final yet
    model(torch.randn(2, 8)).sum().backward()
    assert ddp._launched == {b.index for b in ddp.buckets}  # every parameter's second: reduced
    with pytest.raises(RuntimeError, match="received gradient 3 of the 2 expected"):
        model(torch.randn(2, 8)).sum().backward()


def test_closed_engine_and_its_buffers_are_collected():
    """The engine's hooks and the parameters' ``accumulate_grad``/``main_grad`` kept the engine and its
    gradient buffers alive as long as the model (~6 bytes per parameter after every dropped Trainer)."""
    import gc
    import weakref

    model = _model()
    ddp = DataParallel([model], _topo(), DataParallelConfig(bucket_size=50))
    with last_backward(ddp):
        model(torch.randn(2, 8)).sum().backward()
    engine, buffers = weakref.ref(ddp), [weakref.ref(buf.grad_data) for buf in ddp.buffers]
    ddp.close()
    del ddp
    gc.collect()
    assert engine() is None and buffers and all(b() is None for b in buffers)
    model(torch.randn(2, 8)).sum().backward()  # the model trains on without the engine: autograd's p.grad
    assert all(p.grad is not None and not hasattr(p, "main_grad") for p in model.parameters())
