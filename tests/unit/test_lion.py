"""Lion on one process: the optimizer's update over its pieces against the formula written here
independently (sign of the interpolated momentum, decoupled decay on matrices only, clipping), its one fp32
moment per element (``(1 - beta2) g`` after the first step) and its place in the registry."""

from types import SimpleNamespace

import pytest
import torch

from megand.core.distributed import DataParallel, DataParallelConfig, last_backward
from megand.core.optimizer import Optimizer, OptimizerConfig
from megand.core.optimizer.registry import optimizer_for
from megand.core.sharding import BIAS, MATRIX, NORM, ROLES, ParamMeta, tag
from megand.tools.estimate_memory import Layout, estimate_memory
from megand.tools.planner.cluster import parse_cluster
from megand.tools.planner.cost import predict
from megand.tools.planner.layout import Candidate


def _topo():
    return SimpleNamespace(dp_cp_group=None, dp_cp_size=1, dp_cp_rank=0, tp_size=1, pp_size=1, world_size=1,
                           device=torch.device("cpu"), tp_group=None)





class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(8, 12)
        self.scale = torch.nn.Parameter(torch.ones(12))  # a norm weight: no decay
        self.out = torch.nn.Linear(12, 3)
        for name, p in self.named_parameters():
            tag(p, ParamMeta(tuple(p.shape), role=NORM if name == "scale" else BIAS if name.endswith("bias") else MATRIX))

    def forward(self, x):
        return self.out(torch.tanh(self.fc(x)) * self.scale)


@pytest.mark.parametrize("clip_grad", [0.0, 0.05])  # 0.05: every step clips
def test_lion_step_matches_the_formula(clip_grad):
    lr, wd, b1, b2 = 0.01, 0.3, 0.9, 0.99
    cfg = OptimizerConfig(name="lion", lr=lr, min_lr=lr, warmup_iters=0, schedule="constant", weight_decay=wd,
                          beta1=b1, beta2=b2, clip_grad=clip_grad)
    net, ref = Net(), Net()
    ddp = DataParallel([net], _topo(), DataParallelConfig(bucket_size=40))
    opt = Optimizer(list(net.named_parameters()), cfg, _topo(), ddp)
    assert {x.optimizer for x in opt.pieces} == {"lion"}
    moments = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
    for step in range(4):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        ref.zero_grad()
        with last_backward(ddp):
            net(x).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        result = opt.step()
        norm = torch.cat([p.grad.flatten() for p in ref.parameters()]).norm().item()
        assert result.grad_norm == pytest.approx(norm, rel=1e-6)
        coef = min(1.0, clip_grad / (norm + 1e-6)) if clip_grad else 1.0
        with torch.no_grad():
            for n, p in ref.named_parameters():
                g, m = p.grad * coef, moments[n]
                c = b1 * m + (1 - b1) * g
                decay = wd if n.endswith("weight") else 0.0  # fc.weight, out.weight; not the norm, the biases
                p.sub_(lr * (torch.sign(c) + decay * p))
                m.mul_(b2).add_((1 - b2) * g)
        if step == 0:  # the moment after one step: (1 - beta2) times the (clipped) gradient
            first = {s.name: s.tensors["lion_momentum"] for s in opt.sharded_state_dict()}
            for n, p in ref.named_parameters():
                torch.testing.assert_close(first[n].view(p.shape), (1 - b2) * coef * p.grad, rtol=1e-6, atol=1e-9)
        for (n, p), q in zip(net.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=lambda msg, n=n: f"{n} step {step}: {msg}")
    states = {s.name: s.tensors for s in opt.sharded_state_dict()}
    for n, p in ref.named_parameters():
        assert set(states[n]) == {"lion_momentum"}  # one fp32 moment, the parameter is its own master (fp32)
        torch.testing.assert_close(states[n]["lion_momentum"].view(p.shape), moments[n], rtol=1e-6, atol=1e-9)
    assert sum(t.numel() for t in opt.state_tensors()) == sum(p.numel() for p in net.parameters())


def test_lion_takes_every_role_and_keeps_one_moment_in_the_estimate_and_the_plan():
    assert {optimizer_for("lion", role).name for role in ROLES} == {"lion"}
    model = dict(arch="llama", num_layers=4, hidden_size=256, ffn_hidden_size=512, num_attention_heads=8,
                 num_query_groups=2, seq_length=128, vocab_size=1000, activation="swiglu", norm="rmsnorm",
                 position_embedding="rope", tie_embeddings=False)
    for precision in ("bf16", "fp32"):
        adam = estimate_memory(model, Layout.of(tp=2, dp=4, sharding="optim", precision=precision)).stages[0]
        lion = estimate_memory(model, Layout.of(tp=2, dp=4, sharding="optim", precision=precision,
                                             optimizer="lion")).stages[0]
        # 4 bytes less per parameter (one moment instead of two), over the shard group of dp=4
        assert adam.optimizer_bytes - lion.optimizer_bytes == pytest.approx(4 * adam.params / 4)
        assert (adam.param_bytes, adam.grad_bytes) == (lion.param_bytes, lion.grad_bytes)
    cluster = parse_cluster({"groups": [{"name": "a", "nodes": 1, "devices_per_node": 8, "device": "h100"}]})
    c = Candidate.of(tp=2, dp=1, micro_batch_size=1)  # one replica: the optimizer's time is its update alone
    adam, lion = (predict(model, c.with_(optimizer=name), 32, [cluster.groups[0]]) for name in ("adamw", "lion"))
    # a memory-bound step over 28 bytes per element instead of 36, and 4 bytes less state per parameter
    assert lion.parts["optimizer_s"] == pytest.approx(adam.parts["optimizer_s"] * 28 / 36)
    assert lion.mem_peak_gib[0] < adam.mem_peak_gib[0]


def test_a_parameter_without_a_role_is_refused():
    p = tag(torch.nn.Parameter(torch.zeros(4, 4)), ParamMeta((4, 4)))
    with pytest.raises(ValueError, match="w: its ParamMeta declares no role"):
        Optimizer([("w", p)], OptimizerConfig(), _topo())
