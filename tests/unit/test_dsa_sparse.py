"""DeepSeek Sparse Attention's top-k path (gathering each query's chosen keys by blocks of queries) equals the
dense-mask reference: the attention core alone in fp64 (1e-10, forward and backward, grouped and single
key heads, several blocks, queries with fewer valid keys than k), and a whole DeepSeek-V3.2 model (logits,
per-token loss, the indexer loss and every parameter's gradient, within documents) in fp64 and in fp32 at
the correctness protocol's per-tensor tolerance. The path choice is one rule (:func:`use_sparse`)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megand.core.checkpointing import offline
from megand.core.transformer import dsa, dsa_sparse
from megand.core.transformer.documents import DocumentMask
from megand.models import full

V32 = dict(arch="llama", num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, seq_length=32,
           vocab_size=128, norm="rmsnorm", norm_eps=1e-6, activation="swiglu", position_embedding="rope",
           tie_embeddings=False, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
           v_head_dim=12, dsa_index_topk=5, dsa_index_heads=16, dsa_index_head_dim=16, dsa_indexer_loss_coeff=0.5,
           init_std=0.2)  # peaked distributions: at 0.02 both are near uniform and their KL (~5e-5) is all
# cancellation, fp32 noise of ~1e-4 of itself on either path


@pytest.fixture(scope="module")
def topo():
    yield offline.single_process_topology()
    dist.destroy_process_group()  # leave no process group to the next module


def dense_reference(q, k, v, index, valid):
    """SDPA over a boolean mask of the chosen keys (the dense path's core)."""
    b, h, sq, _ = q.shape
    # several slots may hold one (invalid) key: a valid slot's True must survive an invalid one's False
    mask = torch.zeros(b, sq, k.shape[2], dtype=torch.float64).scatter_add_(-1, index, valid.double()) > 0
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=k.shape[1] != h)


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_sparse_core_equals_the_dense_mask_fp64(kv_heads):
    g = torch.Generator().manual_seed(0)
    b, h, sq, sk, d, dv, topk = 2, 4, 11, 19, 8, 6, 5
    q = torch.randn(b, h, sq, d, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, kv_heads, sk, d, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, kv_heads, sk, dv, generator=g, dtype=torch.float64, requires_grad=True)
    index = torch.stack([torch.randperm(sk, generator=g)[:topk] for _ in range(b * sq)]).view(b, sq, topk)
    valid = torch.rand(b, sq, topk, generator=g) > 0.3
    valid[..., 0] = True  # every query sees at least one key
    out = dsa_sparse.sparse_attention(q, k, v, index, valid, step=3)
    ref = dense_reference(q, k, v, index, valid)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    g_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    ours = torch.autograd.grad(out, (q, k, v), g_out)
    theirs = torch.autograd.grad(ref, (q, k, v), g_out)
    for a, r in zip(ours, theirs):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)


def test_selection_by_blocks_is_the_dense_selection():
    """The blocks' top-k indices mark exactly the dense reference's chosen keys (ties included)."""
    g = torch.Generator().manual_seed(1)
    scores = torch.randint(0, 3, (2, 13, 13), generator=g).double()  # many ties
    allowed = torch.ones(13, 13, dtype=torch.bool).tril()[None]
    index, valid = dsa_sparse.select_topk(lambda lo, hi: scores[:, lo:hi], lambda lo, hi: allowed[:, lo:hi],
                                          13, 13, 4, per_query=dsa_sparse.BLOCK_ELEMENTS // 3)
    chosen = torch.zeros(2, 13, 13, dtype=torch.float64).scatter_add_(-1, index, valid.double()) > 0
    dense = dsa.Indexer.select(type("I", (), {"topk": 4})(), scores, allowed)
    assert torch.equal(chosen, dense)


def model_step(model, ids, documents):
    model.train()
    for m in dsa.indexers([model]):
        m.loss_sum, m.terms, m.loss_scale = torch.zeros((), dtype=torch.float64), 0, 1.0
    model.zero_grad()
    s = ids.shape[1] - 1
    loss = model(input_ids=ids[:, :-1], positions=torch.arange(s), labels=ids[:, 1:], documents=documents)
    loss.mean().backward()
    indexer_loss = sum(m.loss_sum for m in dsa.indexers([model]))
    return loss.detach(), indexer_loss, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float64, pytest.param(torch.float32, marks=pytest.mark.slow)])
def test_model_on_the_top_k_path_equals_the_dense_mask(topo, monkeypatch, dtype):
    """Several blocks of queries (a small budget), documents, the indexer loss: the same loss, indexer loss and
    gradients on both paths (fp64 1e-10; fp32 the protocol's per-tensor 5e-6)."""
    model = full.build_full_model(V32, topo=topo).to(dtype)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 128, (2, 33), generator=g)
    documents = DocumentMask(torch.tensor([[0] * 20 + [1] * 12, [0] * 7 + [1] * 25]))
    assert dsa_sparse.use_sparse(32, 5) and not dsa_sparse.use_sparse(32, 8)
    monkeypatch.setattr(dsa_sparse, "BLOCK_ELEMENTS", 5000)  # several blocks of queries
    sparse = model_step(model, ids, documents)
    monkeypatch.setattr(dsa, "use_sparse", lambda keys, topk: False)
    dense = model_step(model, ids, documents)
    tol = 1e-10 if dtype == torch.float64 else 5e-6
    torch.testing.assert_close(sparse[0], dense[0], rtol=tol, atol=0)
    assert dense[1] > 0
    torch.testing.assert_close(sparse[1], dense[1], rtol=tol, atol=0)
    indexer_grads = 0
    for name, grad in dense[2].items():
        diff = (sparse[2][name] - grad).norm() / grad.norm().clamp_min(1e-30)
        assert diff <= tol, (name, diff.item())
        indexer_grads += ".indexer." in name and grad.norm() > 0
    assert indexer_grads == 2 * 5  # wq, wk, k_norm (weight, bias), weights: trained by the indexer loss


def saved_bytes_per_token(model, seq):
    """Bytes autograd keeps for backward (distinct storages) per token of a training forward."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, 128, (1, seq + 1), generator=torch.Generator().manual_seed(3))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids[:, :-1], positions=torch.arange(seq), labels=ids[:, 1:])
    return sum(storages.values()) / seq


def test_top_k_path_memory_grows_with_the_sequence_times_k_not_its_square(topo, monkeypatch):
    """Doubling the sequence at a fixed k keeps the bytes per token the top-k path saves for backward (its
    blocks keep their inputs and the chosen indices), while the dense mask's grow with s."""
    model = full.build_full_model(dict(V32, seq_length=256), topo=topo).train()
    sparse = [saved_bytes_per_token(model, s) for s in (128, 256)]
    monkeypatch.setattr(dsa, "use_sparse", lambda keys, topk: False)
    dense = [saved_bytes_per_token(model, s) for s in (128, 256)]
    assert sparse[1] <= sparse[0] * 1.01, sparse
    assert dense[1] - dense[0] >= 2 * 128 * 4, dense  # at least the s-wide bool mask and fp32 scores per token


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_top_k_path_under_recomputation_is_unchanged(topo, recompute):
    """Recomputation replays the top-k path (its blocks recompute inside the replay): the same loss, gradients
    and indexer loss (counted once: the replay adds no term)."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 128, (2, 33), generator=g)
    runs = [model_step(full.build_full_model(dict(V32, recompute=rc), topo=topo).double(), ids, None)
            for rc in ("none", recompute)]
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=1e-12, atol=0)
    torch.testing.assert_close(runs[1][1], runs[0][1], rtol=1e-12, atol=0)
    for name, grad in runs[0][2].items():
        torch.testing.assert_close(runs[1][2][name], grad, rtol=1e-12, atol=1e-15)
