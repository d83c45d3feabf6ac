"""The MoE block on one process against plain per-token references: routing (ties, both routers), the
grouped GEMM, the capacity rule, the balancing losses and their gradient."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megand.core.checkpointing.offline import single_process_topology
from megand.core.sharding import init_parameters
from megand.core.transformer import TransformerConfig
from megand.core.transformer.moe import MoE, Router, capacity_keep, grouped_linear


@pytest.fixture(scope="module")
def topo():
    topo = single_process_topology()
    yield topo
    dist.destroy_process_group()


def config(**changes):
    base = dict(arch="llama", num_layers=2, hidden_size=16, ffn_hidden_size=32, num_attention_heads=2,
                norm="rmsnorm", activation="swiglu", num_experts=4, moe_top_k=2, moe_ffn_hidden_size=8)
    return TransformerConfig(**{**base, **changes})


def build(topo, seed=3, **changes):
    moe = MoE(config(**changes), topo)
    init_parameters(moe, seed)
    with torch.no_grad():  # larger router weights: decisive, varied routing
        moe.router.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(seed))
    return moe


def test_ties_go_to_the_lower_expert_index(topo):
    for kind in ("softmax", "sigmoid"):
        router = Router(config(moe_router=kind, num_experts=6, moe_top_k=3), topo, False, "cpu")
        with torch.no_grad():
            router.weight.zero_()  # every score equal
        _, _, experts, weights = router(torch.randn(5, 16))
        assert experts.tolist() == [[0, 1, 2]] * 5, kind
        torch.testing.assert_close(weights, torch.full((5, 3), 1 / 3))


def test_sigmoid_router_chooses_by_score_plus_bias_and_weights_by_score(topo):
    router = Router(config(moe_router="sigmoid"), topo, False, "cpu")
    with torch.no_grad():
        router.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(0))
        router.expert_bias.copy_(torch.tensor([0.0, 0.0, 10.0, 10.0]))  # forces experts 2 and 3
    x = torch.randn(7, 16)
    _, scores, experts, weights = router(x)
    assert experts.sort(-1).values.tolist() == [[2, 3]] * 7
    s = torch.sigmoid(x @ router.weight.t()).gather(1, experts)
    torch.testing.assert_close(scores.gather(1, experts), s)
    torch.testing.assert_close(weights, s / s.sum(-1, keepdim=True))


def test_grouped_linear_loop_equals_per_row_products():
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(3, 5, 4, generator=g), torch.randn(3, 5, generator=g)
    counts = torch.tensor([2, 0, 3])
    x = torch.randn(6, 4, generator=g)  # the last row belongs to no expert
    out = grouped_linear(x, weight, counts, torch.cumsum(counts, 0).to(torch.int32), bias)
    owner = [0, 0, 2, 2, 2]
    expected = torch.stack([weight[e] @ x[i] + bias[e] for i, e in enumerate(owner)] + [torch.zeros(5)])
    torch.testing.assert_close(out, expected)


def reference_capacity_keep(experts, scores, num_experts, capacity):
    """The capacity rule in plain python: per expert, keep the ``capacity`` best scores; among equal
    scores the earlier token."""
    keep = [[False] * len(row) for row in experts]
    for e in range(num_experts):
        mine = [(-scores[t][j], t, j) for t, row in enumerate(experts) for j, x in enumerate(row) if x == e]
        for _, t, j in sorted(mine)[:capacity]:
            keep[t][j] = True
    return keep


def test_capacity_keep_matches_the_plain_rule():
    g = torch.Generator().manual_seed(1)
    for trial in range(20):
        t, e, k = 13, 5, 2
        experts = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        scores = torch.randint(0, 4, (t, k), generator=g).float() / 4  # many ties
        capacity = 1 + trial % 5
        keep = capacity_keep(experts, scores, e, capacity)
        assert keep.tolist() == reference_capacity_keep(experts.tolist(), scores.tolist(), e, capacity), trial


def expert_mlp(moe, e, token):
    """Expert e on one token (SwiGLU or GPT's tanh-GELU with biases)."""
    fc1, fc2 = moe.experts.fc1, moe.experts.fc2
    h = fc1.weight[e] @ token + (0 if fc1.bias is None else fc1.bias[e])
    if moe.cfg.activation == "swiglu":
        h = h.view(-1, 2)
        h = F.silu(h[:, 0]) * h[:, 1]
    else:
        h = F.gelu(h, approximate="tanh")
    return fc2.weight[e] @ h + (0 if fc2.bias is None else fc2.bias[e])


def reference_forward(moe, x):
    """Per token: route in fp32, run each chosen expert on its own, weight and sum; the shared experts."""
    cfg = moe.cfg
    w_r = moe.router.weight.float()
    rows = []
    for token in x.reshape(-1, x.shape[-1]):
        logits = w_r @ token.float()
        if cfg.moe_router == "softmax":
            scores = torch.softmax(logits, -1)
            chosen = sorted(range(cfg.num_experts), key=lambda e: (-scores[e].item(), e))[: cfg.moe_top_k]
            w = scores[chosen]
            w = w / w.sum() if cfg.moe_norm_topk_prob else w
        else:
            scores = torch.sigmoid(logits)
            biased = scores + moe.router.expert_bias
            chosen = sorted(range(cfg.num_experts), key=lambda e: (-biased[e].item(), e))[: cfg.moe_top_k]
            w = scores[chosen] / scores[chosen].sum()
        y = torch.zeros_like(token)
        for weight, e in zip(w, chosen):
            y = y + weight * expert_mlp(moe, e, token)
        rows.append(y)
    out = torch.stack(rows).view_as(x)
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(x)
    return out


GPT = {"arch": "gpt", "norm": "layernorm", "activation": "gelu"}  # tanh-GELU experts with biases


@pytest.mark.parametrize("changes", [{}, {"moe_router": "sigmoid"}, {"moe_norm_topk_prob": False},
                                     {"moe_shared_experts": 2, "moe_shared_expert_gate": True}, GPT],
                         ids=["softmax", "sigmoid", "softmax-unnormalised", "shared-gated", "gpt-biases"])
def test_block_equals_the_per_token_reference(topo, changes):
    moe = build(topo, **changes).eval()
    with torch.no_grad():  # biases drawn, not the init's zeros, so that a misplaced one shows
        for p in (moe.experts.fc1.bias, moe.experts.fc2.bias):
            if p is not None:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(8))
    if moe.router.expert_bias is not None:
        moe.router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    x = torch.randn(6, 3, 16, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(moe(x), reference_forward(moe, x))


def test_balancing_losses_and_their_gradient(topo):
    """The aux loss (Switch form) and z-loss reach the router weight with their coefficients, scaled by
    the step's gradient scale; the logged values are the unweighted terms."""
    aux_coeff, z_coeff, scale = 0.3, 0.05, 0.5
    moe = build(topo, moe_aux_loss_coeff=aux_coeff, moe_z_loss_coeff=z_coeff).train()
    moe.loss_scale = scale
    x = torch.randn(8, 2, 16, generator=torch.Generator().manual_seed(4))
    moe(x).sum().backward()
    with_losses = moe.router.weight.grad.clone()
    moe.router.weight.grad = None
    moe.loss_scale = 0.0
    moe(x).sum().backward()
    plain = moe.router.weight.grad.clone()

    w = moe.router.weight.detach().clone().requires_grad_()
    logits = x.reshape(-1, 16) @ w.t()
    scores = torch.softmax(logits, -1)
    chosen = torch.sort(scores.detach(), dim=-1, descending=True, stable=True).indices[:, :2]
    share = torch.zeros(4).scatter_add_(0, chosen.reshape(-1), torch.ones(chosen.numel())) / chosen.numel()
    aux = 4 * (share * scores.mean(0)).sum()
    z = torch.logsumexp(logits, -1).square().mean()
    ((aux_coeff * aux + z_coeff * z) * scale).backward()
    torch.testing.assert_close(with_losses - plain, w.grad, rtol=1e-5, atol=1e-7)
    assert moe.stats.microbatches == 2
    torch.testing.assert_close(moe.stats.aux / 2, aux.detach())
    torch.testing.assert_close(moe.stats.z / 2, z.detach())
    assert moe.stats.load.tolist() == (2 * share * chosen.numel()).tolist()


def test_dropped_assignments_get_no_output(topo):
    moe = build(topo, moe_capacity_factor=0.5).train()
    x = torch.randn(8, 1, 16, generator=torch.Generator().manual_seed(5))
    tokens = x.reshape(-1, 16)
    _, scores, experts, weights = moe.router(tokens)
    capacity = math.ceil(0.5 * 8 * 2 / 4)
    keep = torch.tensor(reference_capacity_keep(experts.tolist(), scores.gather(1, experts).tolist(), 4, capacity))
    out = moe(x).reshape(-1, 16)
    for t in range(8):
        y = torch.zeros(16)
        for j in range(2):
            if keep[t, j]:
                y = y + weights[t, j] * expert_mlp(moe, experts[t, j], tokens[t])
        torch.testing.assert_close(out[t], y)
    assert moe.stats.dropped.item() == (~keep).sum().item() > 0


def test_fused_grouped_gemm_equals_the_loop_with_dropped_rows():
    """torch's grouped GEMM (the CUDA bf16 path; it also runs on CPU in fp32) against the loop, values
    and gradients, with rows of no expert at the end (dropped assignments, masked by the dispatcher)."""
    g = torch.Generator().manual_seed(6)
    weight, bias = torch.randn(3, 12, 8, generator=g), torch.randn(3, 12, generator=g)
    counts = torch.tensor([2, 0, 3])
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(7, 8, generator=g)
    grad = torch.randn(7, 12, generator=g)
    grad[5:] = 0.0  # the dispatcher masks the rows of no expert
    results = []
    for fused in (False, True):
        w, b, xx = (t.clone().requires_grad_() for t in (weight, bias, x))
        out = grouped_linear(xx, w, counts, offsets, b, fused=fused)
        out.backward(grad)
        results.append((out[:5], w.grad, b.grad, xx.grad))
    for loop, fused in zip(*results):
        torch.testing.assert_close(fused, loop)


def test_balancing_losses_reach_the_router_in_compiled_layers(topo):
    """``train.compile``: the layer is compiled, the balancing losses' gradient still reaches the router."""
    from megand.core.tensor_parallel import TensorParallelRNG
    from megand.core.transformer import TransformerLayer
    from megand.training.compile import compile_layers

    cfg = config(moe_aux_loss_coeff=0.3, moe_z_loss_coeff=0.05, num_layers=1)
    x = torch.randn(8, 2, 16, generator=torch.Generator().manual_seed(7))
    grads = []
    for compiled in (False, True):
        chunk = torch.nn.Module()
        chunk.layers = torch.nn.ModuleDict({"0": TransformerLayer(cfg, topo, TensorParallelRNG(0, 0, topo.device))})
        init_parameters(chunk, 3)
        chunk.layers["0"].mlp.loss_scale = 0.5
        if compiled:
            compile_layers([chunk])
        chunk.layers["0"](x).sum().backward()
        grads.append(chunk.layers["0"].mlp.router.weight.grad)
    torch.testing.assert_close(grads[1], grads[0])
