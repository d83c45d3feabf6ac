"""The attention kernels CUDA runs, checked on CPU: fake CUDA tensors run the fused kernels' meta
functions, so the exact CUDA code path executes without a GPU."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from megand.core import sdpa
from megand.core.checkpointing.offline import single_process_topology
from megand.core.sdpa import attention_backend, causal_attention
from megand.core.tensor_parallel.random import TensorParallelRNG
from megand.core.transformer import TransformerConfig
from megand.core.transformer.documents import DocumentMask


class Shapes(TorchDispatchMode):
    """Records the shape of every tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.outputs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.outputs.append((str(func), tuple(t.shape)))
        return out


@pytest.mark.parametrize("dtype, groups, head_dim, expected", [
    (torch.float32, 2, 64, "efficient (K/V expanded)"),  # fp32 GQA: was the math kernel
    (torch.float32, 8, 64, "efficient"),
    (torch.bfloat16, 2, 64, "flash"),
    (torch.bfloat16, 2, 320, "efficient (K/V expanded)"),  # above flash's head dim limit
])
def test_cuda_attention_never_materialises_scores(dtype, groups, head_dim, expected):
    s = 128
    with FakeTensorMode(), torch.no_grad():
        q = torch.empty(2, 8, s, head_dim, device="cuda", dtype=dtype)
        k, v = (torch.empty(2, groups, s, head_dim, device="cuda", dtype=dtype) for _ in range(2))
        with Shapes() as shapes:
            out = causal_attention(q, k, v)
    assert attention_backend("cuda", dtype, head_dim, 8, groups) == expected
    assert out.shape == q.shape and out.dtype == dtype
    quadratic = [(op, shape) for op, shape in shapes.outputs if shape[-2:] == (s, s)]
    assert not quadratic, quadratic
    kernel = "flash" if expected == "flash" else "efficient"
    assert any(kernel in op for op, _ in shapes.outputs), shapes.outputs


def test_expanded_kv_pairs_each_query_head_with_its_group(monkeypatch):
    """The K/V expansion for the efficient kernel keeps torch's GQA pairing (query head i reads K/V head
    i // (heads / groups)); the kernel itself is stood in for by SDPA on CPU."""
    monkeypatch.setattr(sdpa, "_efficient", lambda q, k, v, p, scale: F.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale))
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(causal_attention(q, k, v, backend="efficient (K/V expanded)"), expected)


def test_cpu_backend_is_torchs_choice():
    assert attention_backend("cpu", torch.float32, 64, 8, 2) in ("flash", "math")


# ------------------------------------------------------------------------------- compile: RNG graph breaks
@pytest.fixture(scope="module")
def topo():
    yield single_process_topology()
    dist.destroy_process_group()


def test_compiled_layer_has_no_rng_graph_break_without_dropout(topo):
    from torch._dynamo.utils import counters

    from megand.core.transformer.layer import TransformerLayer

    cfg = TransformerConfig(arch="llama", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                            num_query_groups=2, seq_length=16, vocab_size=64, norm="rmsnorm", activation="swiglu",
                            position_embedding="rope")
    layer = TransformerLayer(cfg, topo, TensorParallelRNG(1, 0, torch.device("cpu")), torch.device("cpu"))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, backend="eager")
    x = torch.randn(16, 2, 64, requires_grad=True)
    compiled(x).sum().backward()
    breaks = dict(counters["graph_break"])
    torch._dynamo.reset()
    assert not [reason for reason in breaks if "rng_state" in reason], breaks


# ------------------------------------------------------------------------------- document block masks
def test_document_block_mask_is_built_once_per_microbatch(monkeypatch):
    import torch.nn.attention.flex_attention as flex

    from megand.core.transformer import documents

    built = []
    monkeypatch.setattr(flex, "create_block_mask", lambda mask_mod, **kw: built.append(kw) or object())
    monkeypatch.setattr(documents, "_compiled_flex_attention", lambda: lambda q, k, v, **kw: q)
    with FakeTensorMode():
        ids = torch.zeros(2, 32, dtype=torch.long, device="cuda")
        mask = DocumentMask(ids)
        for _layer in range(4):  # every layer's fresh q, k, v
            q, k = torch.empty(2, 4, 32, 8, device="cuda"), torch.empty(2, 2, 32, 8, device="cuda")
            mask.attend(q, k, k)
        assert len(built) == 1
        # other positions (same length) get their own mask, never another positions' one
        first, second = torch.arange(16, device="cuda"), torch.arange(16, 32, device="cuda")
        q16, k16 = torch.empty(2, 4, 16, 8, device="cuda"), torch.empty(2, 2, 16, 8, device="cuda")
        mask.attend(q16, k16, k16, first, first)
        mask.attend(q16, k16, k16, second, second)
        mask.attend(q16, k16, k16, first, first)
        assert len(built) == 3
        # the next micro-batch builds its own
        DocumentMask(ids).attend(q, k, k)
        assert len(built) == 4


def test_layer_attention_on_cuda_fp32_gqa_runs_a_fused_kernel(topo):
    from megand.core.transformer.attention import Attention

    cfg = TransformerConfig(arch="llama", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=8,
                            num_query_groups=2, seq_length=128, vocab_size=64, norm="rmsnorm", activation="swiglu",
                            position_embedding="rope")
    attention = Attention(cfg, topo, TensorParallelRNG(1, 0, torch.device("cpu")), torch.device("cpu")).train()
    s = 128
    with FakeTensorMode(), torch.no_grad():
        q = torch.empty(1, 8, s, 8, device="cuda")
        k, v = torch.empty(1, 2, s, 8, device="cuda"), torch.empty(1, 2, s, 8, device="cuda")
        with Shapes() as shapes:
            attention.core(q, k, v)
    assert not [shape for _, shape in shapes.outputs if shape[-2:] == (s, s)], shapes.outputs


def test_attention_summary_names_the_kernel_of_each_layout():
    from megand.core.sdpa import attention_summary

    assert attention_summary("cuda", torch.float32, 128, 32, 8) == "SDPA efficient (K/V expanded)"
    assert attention_summary("cuda", torch.bfloat16, 128, 32, 8) == "SDPA flash"
    assert attention_summary("cuda", torch.bfloat16, 128, 32, 8, documents=True).startswith("FlexAttention")
    assert attention_summary("cuda", torch.bfloat16, 128, 32, 8, cp=2).endswith("on flash blocks")
    assert "explicit fp32 blocks" in attention_summary("cuda", torch.float32, 128, 32, 8, cp=2, cp_comm="all_gather")
    assert attention_summary("cuda", torch.float32, 128, 32, 8, cp=4, cp_comm="a2a") == "SDPA efficient (K/V expanded)"
    assert attention_summary("cuda", torch.float32, 128, 32, 32, cp=4, cp_comm="a2a") == "SDPA efficient"


def test_the_cuda_kernel_choice_compiles_without_a_graph_break():
    """Compiled layers choose the kernel at trace time (the device's capability is a constant)."""
    from torch._dynamo.utils import counters

    def layer(x):
        kernel = attention_backend(torch.device("cuda"), torch.float32, 64, 8, 2)
        return x * 2 if kernel.startswith("efficient") else x

    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(layer, backend="eager")(torch.ones(3))
    breaks = dict(counters["graph_break"])
    torch._dynamo.reset()
    assert not breaks, breaks
    assert torch.equal(out, torch.full((3,), 2.0))
