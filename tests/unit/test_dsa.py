"""DeepSeek Sparse Attention's pieces on their own: the top-k selection (allowed keys only, ties towards the
earlier key, every allowed key while a query has fewer than k) and the indexer loss against DeepSeek's formula
written out."""

import torch

from megand.core.transformer.dsa import Indexer, indexer_kl


def select(scores, allowed, k=2):
    return Indexer.select(type("I", (), {"topk": k})(), scores, allowed)


def test_selection_takes_the_best_allowed_keys_and_breaks_ties_towards_the_earlier_key():
    scores = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 9.0]]])
    allowed = torch.ones(4, 4, dtype=torch.bool).tril()[None]
    chosen = select(scores, allowed)
    assert chosen[0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1]]


def test_indexer_loss_is_deepseeks_kl_over_the_chosen_keys():
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(2, 5, 7, generator=g)  # the main attention's probabilities summed over heads
    scores = torch.randn(2, 5, 7, generator=g)
    chosen = torch.rand(2, 5, 7, generator=g) > 0.4
    chosen[..., 0] = True
    ours = indexer_kl(scores, probs, chosen)
    for b in range(2):
        for t in range(5):
            keep = chosen[b, t]
            p = probs[b, t, keep] / probs[b, t, keep].sum()
            log_q = torch.log_softmax(scores[b, t, keep], -1)
            torch.testing.assert_close(ours[b, t], (p * (p.log() - log_q)).sum())


def test_indexer_loss_metric_counts_every_replicas_terms_under_uneven_shares():
    """Under uneven batch shares (``parallel.dp_microbatches``) each replica's micro-batches are its own terms:
    every replica's first rank counts its terms (even shares: one micro-batch spans the replicas, counted once)."""
    from types import SimpleNamespace

    from megand.core.transformer.dsa import step_metrics

    indexer = Indexer.__new__(Indexer)
    torch.nn.Module.__init__(indexer)
    indexer.loss_sum, indexer.terms = torch.tensor(0.75), 3
    cfg = SimpleNamespace(dsa_index_topk=4, dsa_indexer_loss_coeff=1.0)
    for uneven, dp_rank, count in ((True, 1, 3.0), (False, 1, 0.0), (False, 0, 3.0), (True, 0, 3.0)):
        topo = SimpleNamespace(tp_rank=0, cp_rank=0, dp_rank=dp_rank, device="cpu",
                               layout=SimpleNamespace(uneven_shares=uneven))
        (metric,) = step_metrics([indexer], cfg, topo)
        assert float(metric.value) == 0.75 and metric.count == count, (uneven, dp_rank, metric)
