"""Ring, all-gather and all-to-all (Ulysses) context-parallel attention against single-process causal SDPA,
and their memory."""

import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megand.core.context_parallel import (all_gather_attention, gather_from_cp, ring_attention, split_for_cp,
                                          ulysses_attention)
from megand.tools.spawn import run_distributed

ATTENTIONS = {"ring": ring_attention, "all_gather": all_gather_attention, "a2a": ulysses_attention}
SEQ, HEAD_DIM = 64, 16
HEADS = [(4, 2, 0.3), (4, 4, None)]  # (nh, ng, softmax_scale): GQA with an explicit scale, MHA with the default


def _parity(attention, group, nh, ng, scale, batch=2):
    """Max abs differences of out, dq, dk, dv on this rank versus causal SDPA on the full sequence."""
    gen = torch.Generator().manual_seed(1234)  # identical full tensors on every rank
    q, dout = (torch.randn(batch, nh, SEQ, HEAD_DIM, generator=gen) for _ in range(2))
    k, v = (torch.randn(batch, ng, SEQ, HEAD_DIM, generator=gen) for _ in range(2))

    ref_q, ref_k, ref_v = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out = F.scaled_dot_product_attention(ref_q, ref_k.repeat_interleave(nh // ng, 1),
                                             ref_v.repeat_interleave(nh // ng, 1), is_causal=True, scale=scale)
    ref_out.backward(dout)

    rank, size = dist.get_rank(group), dist.get_world_size(group)
    local = lambda t: split_for_cp(t, 2, rank, size)  # noqa: E731
    q_l, k_l, v_l = (local(t).requires_grad_() for t in (q, k, v))
    out = attention(q_l, k_l, v_l, group, softmax_scale=scale)
    out.backward(local(dout))
    pairs = {"out": (out, ref_out), "dq": (q_l.grad, ref_q.grad), "dk": (k_l.grad, ref_k.grad),
             "dv": (v_l.grad, ref_v.grad)}
    diffs = {name: (mine - local(ref)).abs().max().item() for name, (mine, ref) in pairs.items()}
    diffs["gathered_out"] = (gather_from_cp(out.detach(), 2, group) - ref_out).abs().max().item()
    return diffs


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages allocated under this mode that are still alive, and their peak."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.seen:
                storage = t.untyped_storage()
                self.seen.add(storage.data_ptr())
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, storage.data_ptr(), storage.nbytes())
        return out

    def _free(self, ptr, nbytes):
        self.seen.discard(ptr)
        self.live -= nbytes


def _memory(attention, group, nh=4, ng=2):
    """(bytes saved for backward, peak bytes allocated during forward+backward) of one attention call."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    q, dout = (torch.randn(1, nh, SEQ // size, HEAD_DIM) for _ in range(2))
    k, v = (torch.randn(1, ng, SEQ // size, HEAD_DIM, requires_grad=True) for _ in range(2))
    q.requires_grad_()
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _LiveBytes() as live:
        attention(q, k, v, group).backward(dout)
    return sum(saved.values()), live.peak


def _cp_groups():
    """On 4 ranks, the cp group of this rank for each layout: cp=1, 2 (neighbours), 2 (strided: group rank !=
    global rank), 4. One spawn for every cp size keeps the test fast; every rank must create every group."""
    rank = dist.get_rank()
    layouts = {"1": [[r] for r in range(4)], "2": [[0, 1], [2, 3]], "2 strided": [[0, 2], [1, 3]]}
    groups = {name: [dist.new_group(ranks) for ranks in rank_lists] for name, rank_lists in layouts.items()}
    mine = {name: next(g for g, ranks in zip(groups[name], layouts[name]) if rank in ranks) for name in layouts}
    return {**mine, "4": dist.group.WORLD}


def _worker():
    results = {"parity": {}, "memory": {}}
    for cp, group in _cp_groups().items():
        for name, attention in ATTENTIONS.items():
            for nh, ng, scale in HEADS:
                results["parity"][(cp, name, nh, ng)] = _parity(attention, group, nh, ng, scale)
            # a2a with MHA: K/V heads split over cp as they are (GQA heads that do not split are repeated first)
            results["memory"][(cp, name)] = _memory(attention, group, ng=4 if name == "a2a" else 2)
    return results


@pytest.fixture(scope="module")
def per_rank():
    return run_distributed(_worker, 4)


@pytest.mark.parametrize("cp", ["1", "2", "2 strided", "4"])
def test_matches_sdpa(per_rank, cp):
    for rank, result in enumerate(per_rank):
        for case, diffs in result["parity"].items():
            if case[0] == cp:
                assert max(diffs.values()) <= 1e-5, (rank, case, diffs)


def test_memory_falls_with_cp(per_rank):
    """At a fixed total sequence, the bytes saved for backward fall as 1/cp, the peak at least as fast (ring, a2a)."""
    for name in ATTENTIONS:
        saved1, peak1 = per_rank[0]["memory"][("1", name)]
        for cp in (2, 4):
            saved = max(r["memory"][(str(cp), name)][0] for r in per_rank)
            peak = max(r["memory"][(str(cp), name)][1] for r in per_rank)
            print(f"{name} cp={cp}: saved for backward {saved}/{saved1} = {saved / saved1:.3f}, "
                  f"peak allocated {peak}/{peak1} = {peak / peak1:.3f} (1/cp = {1 / cp:.3f})")
            assert 0.8 / cp <= saved / saved1 <= 1.2 / cp
            if name != "all_gather":  # the all-gather variant holds the whole sequence's K/V by design
                assert peak / peak1 <= 1.25 / cp
