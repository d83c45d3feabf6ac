"""Gated DeltaNet (Qwen3-Next's linear attention) in one process: the chunked parallel form equals the
token-by-token recurrence in fp64 (1e-10), from a given state, over chunks that do not divide the sequence,
with documents restarting the state, values and gradients; the recurrent generation cache equals re-reading
the window; the configuration refuses a layer pattern it cannot build in one line."""

import pytest
import torch
import torch.distributed as dist

from megand.core.checkpointing import offline
from megand.core.transformer import TransformerConfig
from megand.core.transformer.delta_rule import chunked, l2norm, recurrent
from megand.core.transformer.kv_cache import KVCache
from megand.models import full
from megand.tools import generate

HYBRID = dict(arch="llama", num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
              seq_length=32, vocab_size=251, norm="rmsnorm", activation="swiglu", position_embedding="rope",
              tie_embeddings=False, layer_types=["linear_attention"] * 3 + ["attention"], linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, attention_output_gate=True,
              partial_rotary_factor=0.25, norm_unit_offset=True, qk_norm=True, head_dim=32)


@pytest.fixture(scope="module")
def topo():
    yield offline.single_process_topology()
    dist.destroy_process_group()  # leave no process group to the next module


def inputs(b=2, h=3, s=50, dk=8, dv=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    q, k = l2norm(rand(b, h, s, dk)) * dk ** -0.5, l2norm(rand(b, h, s, dk))
    v, state = rand(b, h, s, dv), rand(b, h, dk, dv)
    decay = -torch.rand(b, h, s, generator=g, dtype=torch.float64) * 2
    beta = torch.rand(b, h, s, generator=g, dtype=torch.float64)
    return q, k, v, decay, beta, state


def test_chunked_form_equals_the_recurrence_fp64():
    q, k, v, g, beta, state = (t.requires_grad_() for t in inputs())
    docs = torch.tensor([[0] * 10 + [1] * 25 + [2] * 15, [3] * 50])  # three documents, then one
    prev = torch.tensor([0, 2])  # the token before: sample 0 continues document 0, sample 1 starts afresh
    for d, p in ((None, None), (docs, prev)):
        for chunk in (16, 64):  # 50 tokens: padded chunks, and one chunk longer than the sequence
            expected = recurrent(q, k, v, g, beta, state, d, p)
            got = chunked(q, k, v, g, beta, state, d, p, chunk=chunk)
            for a, b in zip(got, expected):
                assert (a - b).abs().max().item() <= 1e-10
            weights = [torch.randn_like(t) for t in expected]  # the gradients of every input, the state's included
            grads = [torch.autograd.grad(sum((w * t).sum() for w, t in zip(weights, out)), (q, k, v, g, beta, state))
                     for out in (got, expected)]
            for a, b in zip(*grads):
                assert (a - b).abs().max().item() <= 1e-10


def test_documents_restart_the_state():
    q, k, v, g, beta, state = inputs(b=1)
    docs = torch.tensor([[0] * 20 + [1] * 30])
    whole, _ = chunked(q, k, v, g, beta, state, docs, torch.tensor([0]), chunk=16)
    fresh, _ = recurrent(*(t[:, :, 20:] for t in (q, k, v, g, beta)))  # the second document alone, from zero
    assert (whole[:, :, 20:] - fresh).abs().max().item() <= 1e-10


def test_cut_sequence_continues_exactly():
    """Two stretches, the second from the first's final state: the whole sequence's outputs (what context
    parallelism and the generation cache rely on)."""
    q, k, v, g, beta, state = inputs()
    whole, final = chunked(q, k, v, g, beta, state, chunk=16)
    a, mid = chunked(*(t[:, :, :23] for t in (q, k, v, g, beta)), state, chunk=16)
    b, end = chunked(*(t[:, :, 23:] for t in (q, k, v, g, beta)), mid, chunk=16)
    assert (torch.cat([a, b], dim=2) - whole).abs().max().item() <= 1e-10
    assert (end - final).abs().max().item() <= 1e-10


def test_recurrent_cache_equals_rereading_the_window(topo, tmp_path):
    full.save_random_model(str(tmp_path / "ckpt"), HYBRID, seed=3)
    model, _ = full.load_model(str(tmp_path / "ckpt"), topo)
    ids = torch.randint(0, 251, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model(input_ids=ids)
        cache = KVCache(model.cfg, 2, 32, torch.float32, topo.device, model.layer_ids, model.layers)
        steps = [model(input_ids=ids[:, :5], kv_cache=cache)]  # prefill
        steps.append(model(input_ids=ids[:, 5:8], kv_cache=cache))  # several tokens after a cached prefix
        steps += [model(input_ids=ids[:, i:i + 1], kv_cache=cache) for i in range(8, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=1e-5, atol=1e-5)
    prompt = list(range(7, 27))  # 20 tokens + 24 new ones: crosses the 32-token window
    assert generate.generate(model, prompt, 24, kv_cache=True) == generate.generate(model, prompt, 24, kv_cache=False)


@pytest.mark.parametrize("changes, needle", [
    (dict(layer_types=["linear_attention"] * 3), "model.layer_types"),
    (dict(layer_types=["mamba"] * 4), "model.layer_types"),
    (dict(linear_num_value_heads=3), "model.linear_num_value_heads=3"),
])
def test_bad_patterns_are_refused_in_one_line(changes, needle):
    with pytest.raises(ValueError) as e:
        TransformerConfig.from_model(dict(HYBRID, **changes))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_fp32_gate_gradients_are_as_accurate_as_regrouping():
    """A 64-token chunk's decays come from running sums of tens (g ~ -1.3 per token): formed in fp32 their
    differences lost ~5e-6 of the gates' gradients (one process then differed from a cp run, whose chunks are
    shorter, by more than the per-tensor tolerance). In fp64 the fp32 form is within 1e-6 of fp64's."""
    q, k, v, _, beta, _ = inputs(b=2, h=4, s=64, dk=16, dv=8)
    g = (-1.3 + 0.2 * torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    weight = torch.linspace(-1, 1, 2 * 4 * 64 * 8, dtype=torch.float64).view(2, 4, 64, 8)

    def gate_grad(dtype):
        gate = g.to(dtype).requires_grad_()
        out, _ = chunked(*(t.to(dtype) for t in (q, k, v)), gate, beta.to(dtype), chunk=64)
        return torch.autograd.grad((out.double() * weight).sum(), gate)[0].double()

    exact, fp32 = gate_grad(torch.float64), gate_grad(torch.float32)
    assert ((fp32 - exact).norm() / exact.norm()).item() <= 1e-6


def test_a_dense_qwen3_next_imports_and_exports_as_qwen3_5(topo, tmp_path):
    """Qwen3-Next with ``num_experts=0`` computes what Qwen3.5's language model does: it imports, and exports as
    ``Qwen3_5ForCausalLM`` (the published dense family) with the same logits."""
    import transformers

    from megand.tools import convert_checkpoint

    config = transformers.Qwen3NextConfig(
        vocab_size=251, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=32, tie_word_embeddings=False, num_experts=0,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25})
    torch.manual_seed(0)
    theirs = transformers.Qwen3NextForCausalLM(config).eval()
    with torch.no_grad():  # norm weights and gates away from their init: a misplaced one shows
        for p in theirs.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    theirs.save_pretrained(str(tmp_path / "hf"))
    assert convert_checkpoint.main(["import", "--hf", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 0
    assert convert_checkpoint.main(["export", "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "back"),
                                    "--dtype", "fp32"]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32).eval()
    assert type(back).__name__ == "Qwen3_5ForCausalLM"
    ours, _ = full.load_model(str(tmp_path / "ckpt"), topo)
    ids = torch.randint(0, 251, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(input_ids=ids).logits
        assert (ours(input_ids=ids) - expected).abs().max().item() <= 1e-4
        assert (back(input_ids=ids).logits - expected).abs().max().item() <= 1e-4
