"""Attention within documents: ids and positions from EOD tokens, and a token's output independent of the
other documents packed into its sample."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megand.core.checkpointing.offline import single_process_topology
from megand.core.tensor_parallel.random import TensorParallelRNG
from megand.core.transformer import TransformerConfig
from megand.core.transformer.documents import DocumentMask, document_ids, document_positions
from megand.models.gpt import GPTModel

EOD = 63


@pytest.fixture(scope="module")
def topo():
    yield single_process_topology()
    dist.destroy_process_group()


def test_ids_and_positions_restart_after_each_eod():
    tokens = torch.tensor([[5, 1, EOD, 2, EOD, EOD, 3, 4], [EOD, 7, 7, 7, 7, 7, 7, EOD]])
    ids = document_ids(tokens, EOD)
    assert ids.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert document_positions(ids).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], [0, 0, 1, 2, 3, 4, 5, 6]]


def test_one_document_is_plain_causal_attention():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    ids = torch.zeros(2, 16, dtype=torch.long)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(DocumentMask(ids).attend(q, k, v), expected, rtol=0, atol=1e-6)


def build(topo, arch, recompute):
    cfg = TransformerConfig(arch=arch, num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                            num_query_groups=2 if arch == "llama" else None, seq_length=32, vocab_size=64,
                            norm="rmsnorm" if arch == "llama" else "layernorm",
                            activation="swiglu" if arch == "llama" else "gelu",
                            position_embedding="rope" if arch == "llama" else "learned", recompute=recompute)
    torch.manual_seed(1)
    model = GPTModel(cfg, topo, TensorParallelRNG(1, 0, torch.device("cpu")))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def logits(model, tokens):
    ids = document_ids(tokens, EOD)
    return model(tokens, positions=document_positions(ids), documents=DocumentMask(ids))


@pytest.mark.parametrize("arch, recompute", [("gpt", "none"), ("llama", "selective"), ("llama", "full")])
def test_a_document_does_not_see_the_others_in_its_sample(topo, arch, recompute):
    """Alter the documents around one (their tokens and the first one's length): its logits stay those of
    the document alone."""
    model = build(topo, arch, recompute)
    g = torch.Generator().manual_seed(2)
    middle = torch.randint(0, EOD, (9,), generator=g).tolist() + [EOD]

    def sample(before, after):
        return torch.tensor([before + [EOD] + middle + after][0][:32])[None]

    a = sample(torch.randint(0, EOD, (7,), generator=g).tolist(), torch.randint(0, EOD, (20,), generator=g).tolist())
    b = sample(torch.randint(0, EOD, (12,), generator=g).tolist(), torch.randint(0, EOD, (20,), generator=g).tolist())
    out_a, out_b = logits(model, a)[0, 8:18], logits(model, b)[0, 13:23]
    torch.testing.assert_close(out_a, out_b, rtol=0, atol=1e-5)
    alone = logits(model, torch.tensor([middle]))[0]
    torch.testing.assert_close(out_a, alone, rtol=0, atol=1e-5)
    # without document masking the same change does reach the middle document
    plain = model(a)[0, 8:18]
    assert (plain - out_a).abs().max() > 1e-3
