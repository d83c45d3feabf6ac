"""The attention kernels CUDA runs, checked on CPU: fake CUDA tensors run the fused kernels' meta
functions, so the exact CUDA code path executes without a GPU."""

from unittest.mock import patch

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

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


def _rules():
    from megand.tools.device_rules import DeviceRules

    return DeviceRules(torch.device("cuda", 0))


@pytest.mark.parametrize("dtype, groups, head_dim, expected", [
    (torch.float32, 2, 64, "efficient (K/V expanded)"),  # fp32 GQA: the one fused kernel takes no grouped K/V
    (torch.float32, 8, 64, "efficient"),
    (torch.bfloat16, 2, 64, "cudnn"),  # SM 9.0 with torch >= 2.9: cuDNN first (was always flash)
    (torch.bfloat16, 2, 192, "flash"),  # above cuDNN's 128
    (torch.bfloat16, 2, 320, "efficient (K/V expanded)"),  # above flash's head dim limit
])
def test_cuda_attention_is_sdpas_choice_and_never_materialises_scores(monkeypatch, dtype, groups, head_dim, expected):
    """On fake CUDA tensors of an SM 9.0 device, with SDPA's CUDA dispatch stood in for by the rehearsal's rules:
    the layer's call reaches SDPA (bf16 called flash attention's op directly before), with grouped K/V where
    the kernel takes them, and the kernel SDPA chooses keeps no ``s x s`` scores."""
    s, calls, rules = 128, [], _rules()
    sdpa_on_cuda = rules.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: calls.append((a, kw)) or sdpa_on_cuda(*a, **kw))
    with FakeTensorMode(), torch.no_grad():
        q = torch.empty(2, 8, s, head_dim, device="cuda", dtype=dtype)
        k, v = (torch.empty(2, groups, s, head_dim, device="cuda", dtype=dtype) for _ in range(2))
        with rules, Shapes() as shapes:
            out = causal_attention(q, k, v)
    assert attention_backend("cuda", dtype, head_dim, 8, groups) == expected
    kernel, expanded = expected.split()[0], expected.endswith("(K/V expanded)")
    assert {backend for backend, _ in rules.backends} == {f"sdpa:{kernel}"}, rules.backends
    assert out.shape == q.shape and out.dtype == dtype
    (args, kwargs), = calls  # one SDPA call
    assert args[1].shape[1] == (8 if expanded else groups) and kwargs["is_causal"]
    assert kwargs["enable_gqa"] == (args[1].shape[1] != 8)
    quadratic = [(op, shape) for op, shape in shapes.outputs if shape[-2:] == (s, s)]
    assert not quadratic, quadratic
    assert any(kernel in op for op, _ in shapes.outputs), shapes.outputs


def test_expanded_kv_pairs_each_query_head_with_its_group(monkeypatch):
    """The K/V expansion for the memory-efficient kernel keeps torch's GQA pairing (query head i reads K/V
    head i // (heads / groups)); on CPU, against SDPA's own grouped attention."""
    from megand.core import sdpa

    monkeypatch.setattr(sdpa, "_expands", lambda *args: True)
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(causal_attention(q, k, v), expected)


def test_cuda_backend_model_follows_torchs_order():
    from megand.core.sdpa import cuda_sdpa_backend

    bf16 = torch.bfloat16
    assert cuda_sdpa_backend((9, 0), bf16, 32, 8, 128, enable_gqa=True) == "cudnn"
    assert cuda_sdpa_backend((10, 0), bf16, 32, 8, 128, enable_gqa=True) == "cudnn"
    assert cuda_sdpa_backend((8, 0), bf16, 32, 8, 128, enable_gqa=True) == "flash"  # A100: cuDNN after math
    assert cuda_sdpa_backend((9, 0), bf16, 32, 8, 128) == "math"  # grouped heads without enable_gqa: none takes them
    assert cuda_sdpa_backend((9, 0), torch.float32, 32, 8, 128, enable_gqa=True) == "math"  # efficient: no GQA
    assert cuda_sdpa_backend((9, 0), torch.float32, 32, 32, 128) == "efficient"
    assert cuda_sdpa_backend((9, 0), bf16, 32, 32, 128, mask=True) == "cudnn"
    assert cuda_sdpa_backend((8, 0), bf16, 32, 32, 128, mask=True) == "efficient"  # flash takes no mask
    assert cuda_sdpa_backend((8, 6), bf16, 8, 8, 200) == "efficient"  # flash's backward refuses d in (192, 224]
    assert cuda_sdpa_backend((9, 0), torch.float32, 8, 8, 66) == "math"  # unaligned head dim


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
    s, rules = 128, _rules()
    with FakeTensorMode(), torch.no_grad(), patch.object(F, "scaled_dot_product_attention",
                                                         rules.scaled_dot_product_attention):
        q = torch.empty(1, 8, s, 8, device="cuda")
        k, v = torch.empty(1, 2, s, 8, device="cuda"), torch.empty(1, 2, s, 8, device="cuda")
        with rules, Shapes() as shapes:
            attention.core(q, k, v)
    assert not [shape for _, shape in shapes.outputs if shape[-2:] == (s, s)], shapes.outputs
    assert {backend for backend, _ in rules.backends} == {"sdpa:efficient"}, rules.backends  # on expanded K/V


def test_attention_summary_names_the_kernel_of_each_layout():
    from megand.core.sdpa import attention_summary

    assert attention_summary("cuda", torch.float32, 128, 32, 8) == "SDPA efficient (K/V expanded)"
    assert attention_summary("cuda", torch.bfloat16, 128, 32, 8) == "SDPA cudnn"
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
