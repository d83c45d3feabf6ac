"""The fused QKV and SwiGLU layouts, through the functions that define them: a layer whose fused weights
are built by ``fuse_qkv``/``fuse_swiglu`` computes the dense attention/MLP of the separate weights, and
``split_*`` inverts ``fuse_*``. These functions are what the Hugging Face adapters use."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megand.core.checkpointing import offline
from megand.core.tensor_parallel import TensorParallelRNG
from megand.core.transformer import TransformerConfig
from megand.core.transformer.attention import Attention, fuse_qkv, split_qkv
from megand.core.transformer.mlp import MLP, fuse_swiglu, split_swiglu


@pytest.fixture(scope="module")
def topo():
    yield offline.single_process_topology()
    dist.destroy_process_group()  # leave no process group to the next module


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (8, 1)])
def test_split_inverts_fuse(heads, groups):
    g = torch.Generator().manual_seed(0)
    d, h = 4, 8
    q, k, v = (torch.randn(n * d, h, generator=g) for n in (heads, groups, groups))
    fused = fuse_qkv(q, k, v, groups)
    assert fused.shape == ((heads + 2 * groups) * d, h)
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, heads, groups), (q, k, v)))
    bias = fuse_qkv(q[:, 0], k[:, 0], v[:, 0], groups)  # biases: no trailing dim
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(bias, heads, groups), (q[:, 0], k[:, 0], v[:, 0])))
    gate, up = torch.randn(6, h, generator=g), torch.randn(6, h, generator=g)
    assert all(torch.equal(a, b) for a, b in zip(split_swiglu(fuse_swiglu(gate, up)), (gate, up)))


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2)])
def test_attention_with_fused_weight_is_dense_attention(topo, heads, groups):
    cfg = TransformerConfig(arch="llama", hidden_size=32, num_attention_heads=heads, num_query_groups=groups,
                            norm="rmsnorm", activation="swiglu", position_embedding="rope")
    attn = Attention(cfg, topo, TensorParallelRNG(0, 0, topo.device)).eval()
    g = torch.Generator().manual_seed(1)
    d, s, b = cfg.head_dim, 6, 2
    wq, wk, wv = (torch.randn(n * d, 32, generator=g) * 0.2 for n in (heads, groups, groups))
    wo = torch.randn(32, heads * d, generator=g) * 0.2
    with torch.no_grad():
        attn.qkv.weight.copy_(fuse_qkv(wq, wk, wv, groups))
        attn.proj.weight.copy_(wo)
    x = torch.randn(s, b, 32, generator=g)
    with torch.no_grad():
        ours = attn(x)
    # dense reference: head j of the queries reads key/value head j // (heads / groups)
    q = (x @ wq.t()).view(s, b, heads, d)
    k = (x @ wk.t()).view(s, b, groups, d).repeat_interleave(heads // groups, dim=2)
    v = (x @ wv.t()).view(s, b, groups, d).repeat_interleave(heads // groups, dim=2)
    scores = torch.einsum("ibhd,jbhd->bhij", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhij,jbhd->ibhd", scores.softmax(-1), v).reshape(s, b, heads * d)
    torch.testing.assert_close(ours, out @ wo.t(), rtol=1e-5, atol=1e-5)


def test_swiglu_mlp_with_fused_weight_is_dense_swiglu(topo):
    cfg = TransformerConfig(arch="llama", hidden_size=16, ffn_hidden_size=24, activation="swiglu")
    mlp = MLP(cfg, topo)
    g = torch.Generator().manual_seed(2)
    gate, up, down = torch.randn(24, 16, generator=g), torch.randn(24, 16, generator=g), torch.randn(16, 24, generator=g)
    with torch.no_grad():
        mlp.fc1.weight.copy_(fuse_swiglu(gate, up))
        mlp.fc2.weight.copy_(down)
        x = torch.randn(5, 2, 16, generator=g)
        torch.testing.assert_close(mlp(x), (F.silu(x @ gate.t()) * (x @ up.t())) @ down.t(), rtol=1e-5, atol=1e-5)


def test_clamped_swiglu_mlp_is_gpt_oss_swiglu(topo):
    """model.swiglu_limit: the dense MLP applies GPT-OSS's clamped SwiGLU to the same fused gate/up rows."""
    cfg = TransformerConfig(arch="llama", hidden_size=16, ffn_hidden_size=24, activation="swiglu", swiglu_limit=1.5,
                            swiglu_alpha=1.702)
    mlp = MLP(cfg, topo)
    g = torch.Generator().manual_seed(2)
    gate, up, down = torch.randn(24, 16, generator=g), torch.randn(24, 16, generator=g), torch.randn(16, 24, generator=g)
    with torch.no_grad():
        mlp.fc1.weight.copy_(fuse_swiglu(gate, up))
        mlp.fc2.weight.copy_(down)
        x = torch.randn(5, 2, 16, generator=g)
        a, b = (x @ gate.t()).clamp(max=1.5), (x @ up.t()).clamp(-1.5, 1.5)
        assert (x @ gate.t()).max() > 1.5  # the clamps act
        torch.testing.assert_close(mlp(x), (a * torch.sigmoid(1.702 * a) * (b + 1)) @ down.t(), rtol=1e-5, atol=1e-5)
