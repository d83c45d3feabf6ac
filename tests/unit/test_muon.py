"""Muon on one process: Newton-Schulz against a float64 reference, the optimizer's updates (momentum,
Nesterov, the per-part orthogonalisation of fused weights, the scale, decoupled weight decay, AdamW for the
rest) against the formula written here independently, and which parameters it takes: by the role the model
declares (the layers' and experts' matrices), never expert biases or a later stage's embedding copy."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megand.core.checkpointing.offline import single_process_topology
from megand.core.distributed import DataParallel, DataParallelConfig, last_backward
from megand.core.optimizer import Optimizer, OptimizerConfig
from megand.core.optimizer.muon import newton_schulz
from megand.core.optimizer.registry import optimizer_for
from megand.core.sharding import BIAS, MATRIX, ROLES, ParamMeta, tag
from megand.core.tensor_parallel.random import TensorParallelRNG
from megand.core.transformer import TransformerConfig
from megand.models.gpt import GPTModel


def ns_float64(g, steps=5):
    """The quintic Newton-Schulz iteration, in float64."""
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(steps):
        a = x @ x.T
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    return x.T if tall else x


@pytest.mark.parametrize("shape", [(16, 64), (64, 16), (32, 32), (3, 40)])
def test_newton_schulz_matches_float64_and_nearly_orthogonalises(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    out = newton_schulz(g)
    assert out.dtype == torch.float32
    ref = ns_float64(g)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=2e-6)
    singular = torch.linalg.svdvals(ref)
    assert singular.min() > 0.6 and singular.max() < 1.25  # the quintic's band around 1
    batched = newton_schulz(torch.stack([g, 2 * g]))  # a stack (experts): each matrix on its own
    torch.testing.assert_close(batched[1], out, rtol=1e-5, atol=1e-6)


def _topo():
    return SimpleNamespace(dp_cp_group=None, dp_cp_size=1, dp_cp_rank=0, tp_size=1, pp_size=1, world_size=1,
                           device=torch.device("cpu"), tp_group=None)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(8, 12)  # a hidden matrix (and its bias: AdamW)
        self.fused = torch.nn.Parameter(torch.randn(12, 6) * 0.3)  # rows alternate two logical matrices
        self.out = torch.nn.Linear(6, 3)
        for name, p in self.named_parameters():
            tag(p, ParamMeta(tuple(p.shape), fused_rows=(1, 1) if name == "fused" else None,
                             role=BIAS if name.endswith("bias") else MATRIX))

    def forward(self, x):
        return self.out(torch.tanh(torch.tanh(self.fc(x)) @ self.fused))


def reference_muon_update(g, buf, fused, mu=0.95):
    buf.mul_(mu).add_(g)
    u = g + mu * buf
    parts = [u[0::2], u[1::2]] if fused else [u]
    outs = [ns_float64(x).float() * 0.2 * math.sqrt(max(x.shape)) for x in parts]
    if not fused:
        return outs[0]
    o = torch.empty_like(u)
    o[0::2], o[1::2] = outs
    return o


def test_muon_step_matches_the_formula():
    lr, wd = 0.02, 0.1
    cfg = OptimizerConfig(name="muon", lr=lr, min_lr=lr, warmup_iters=0, schedule="constant", weight_decay=wd,
                          clip_grad=0.0)
    net, ref = Net(), Net()
    ddp = DataParallel([net], _topo(), DataParallelConfig(bucket_size=40))
    opt = Optimizer(list(net.named_parameters()), cfg, _topo(), ddp)
    assert {x.name for x in opt.pieces if x.optimizer == "muon"} == {"fc.weight", "fused", "out.weight"}
    muon = {"fc.weight", "fused", "out.weight"}
    adam = torch.optim.AdamW([p for n, p in ref.named_parameters() if n not in muon], lr=lr,
                             betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=0.0)  # biases: no decay
    bufs = {n: torch.zeros_like(p) for n, p in ref.named_parameters() if n in muon}
    for step in range(3):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        ref.zero_grad()
        with last_backward(ddp):
            net(x).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        opt.step()
        adam.step()
        with torch.no_grad():
            for n, p in ref.named_parameters():
                if n in muon:
                    p.mul_(1 - lr * wd).sub_(lr * reference_muon_update(p.grad, bufs[n], n == "fused"))
        for (n, p), q in zip(net.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n} step {step}: {m}")
    states = {s.name: s.tensors for s in opt.sharded_state_dict()}
    assert set(states["fc.weight"]) == {"momentum"} and set(states["fc.bias"]) == {"exp_avg", "exp_avg_sq"}
    torch.testing.assert_close(states["fused"]["momentum"].view(12, 6), bufs["fused"])
    assert sum(t.numel() for t in opt.state_tensors()) == sum(p.numel() for p in net.parameters()) + sum(
        p.numel() for n, p in net.named_parameters() if n not in muon)  # one buffer for Muon, two for AdamW


def test_muon_takes_the_matrix_roles_and_adamw_the_rest():
    taken = {role for role in ROLES if optimizer_for("muon", role).name == "muon"}
    assert taken == {"matrix", "expert_matrix"}
    assert {optimizer_for("muon", role).name for role in set(ROLES) - taken} == {"adamw"}


@pytest.fixture(scope="module")
def topo():
    yield single_process_topology()
    dist.destroy_process_group()


def _muon_taken(model, topo):
    """Names of the parameters whose optimizer state is Muon's momentum (the others: AdamW's moments)."""
    cfg = OptimizerConfig(name="muon")
    states = {s.name: set(s.tensors) for s in Optimizer(list(model.named_parameters()), cfg, topo).sharded_state_dict()}
    assert all(kinds in ({"momentum"}, {"exp_avg", "exp_avg_sq"}) for kinds in states.values()), states
    return {name for name, kinds in states.items() if kinds == {"momentum"}}


def _config(**kw):
    return TransformerConfig(**{**dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                                       seq_length=16, vocab_size=64), **kw})


def test_muon_takes_a_gpt_moe_s_matrices_not_its_expert_biases(topo):
    """GPT-style experts have stacked biases ``[E, out]``: matrices by shape, biases by role (AdamW, no decay)."""
    cfg = _config(arch="gpt", norm="layernorm", activation="gelu", position_embedding="learned", num_experts=4,
                  moe_shared_experts=1, moe_shared_expert_gate=True)
    model = GPTModel(cfg, topo, TensorParallelRNG(1, 0, torch.device("cpu")))
    expected = {f"layers.{i}.{m}" for i in range(2) for m in (
        "attention.qkv.weight", "attention.proj.weight", "mlp.experts.fc1.weight", "mlp.experts.fc2.weight",
        "mlp.shared_experts.fc1.weight", "mlp.shared_experts.fc2.weight")}
    assert {n for n, _ in model.named_parameters()} >= expected | {"layers.0.mlp.experts.fc1.bias"}
    assert _muon_taken(model, topo) == expected


@pytest.mark.parametrize("tie", [False, True])
def test_muon_leaves_a_later_stage_s_embedding_copy_to_adamw(topo, tie):
    """The last stage of pp > 1 with multi-token prediction holds a copy of the word embedding (its own table,
    or the tied output layer): AdamW, as the original on the first stage, so that both copies stay equal."""
    cfg = _config(arch="llama", norm="rmsnorm", activation="swiglu", position_embedding="rope", tie_embeddings=tie,
                  mtp_layers=1)
    model = GPTModel(cfg, topo, TensorParallelRNG(1, 0, torch.device("cpu")), layer_ids=[1], pre_process=False)
    names = {n for n, _ in model.named_parameters()}
    assert ("output_layer.weight" if tie else "mtp_embedding.weight") in names
    assert _muon_taken(model, topo) == {n for n in names if n.endswith(("qkv.weight", "proj.weight", "fc1.weight",
                                                                       "fc2.weight"))}
