"""Context-parallel attention within documents (ring, all-gather, all-to-all) against the one-process
document-masked attention: outputs and gradients."""

import pytest
import torch
import torch.distributed as dist

from megand.core.context_parallel import all_gather_attention, ring_attention, split_for_cp, ulysses_attention
from megand.core.transformer.documents import DocumentMask, document_ids
from megand.tools.spawn import run_distributed

ATTENTIONS = {"ring": ring_attention, "all_gather": all_gather_attention, "a2a": ulysses_attention}
SEQ, HEAD_DIM, EOD = 64, 16, 0


def _documents(batch, gen):
    """Short documents (1-12 tokens) in each sample, one long one in the last: fully masked, partial
    and unmasked blocks all occur."""
    tokens = torch.randint(1, 50, (batch, SEQ), generator=gen)
    ends = torch.rand(batch, SEQ, generator=gen) < 0.15
    ends[-1] = False
    tokens[ends] = EOD
    return document_ids(tokens, EOD)


def _parity(kind, nh, ng):
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(7)
    batch = 3
    q, dout = (torch.randn(batch, nh, SEQ, HEAD_DIM, generator=gen) for _ in range(2))
    k, v = (torch.randn(batch, ng, SEQ, HEAD_DIM, generator=gen) for _ in range(2))
    docs = DocumentMask(_documents(batch, gen))
    ref_q, ref_k, ref_v = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out = docs.attend(ref_q, ref_k, ref_v)
    ref_out.backward(dout)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    local = lambda t: split_for_cp(t, 2, rank, size)  # noqa: E731
    q_l, k_l, v_l = (local(t).requires_grad_() for t in (q, k, v))
    out = ATTENTIONS[kind](q_l, k_l, v_l, group, documents=docs)
    out.backward(local(dout))
    pairs = {"out": (out, ref_out), "dq": (q_l.grad, ref_q.grad), "dk": (k_l.grad, ref_k.grad),
             "dv": (v_l.grad, ref_v.grad)}
    return {name: (mine - local(ref)).abs().max().item() for name, (mine, ref) in pairs.items()}


@pytest.mark.parametrize("kind", list(ATTENTIONS))
@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_cp_document_attention_matches_one_process(kind, cp):
    for diffs in run_distributed(_parity, cp, kind, 4, 2 if kind != "a2a" or cp == 2 else 4):
        assert max(diffs.values()) < 1e-5, diffs
