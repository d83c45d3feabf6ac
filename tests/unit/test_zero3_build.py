"""ZeRO-3 model construction: built on the meta device, a rank allocates and initialises only its slices of
the parameters (never the full local replica), with the values the one-process model has there; the
parameters are then usable in a forward and backward. Ranks are played one at a time on torch's fake
process group."""

import torch

from tests.unit.test_init_tiles import WIDE, build_rank

ZERO3 = "optim.sharding=optim_grads_params"


def flat_params(chunks):
    return {n: p.detach().reshape(-1) for c in chunks for n, p in c.named_parameters()}


def test_each_zero3_rank_holds_its_slices_of_the_one_process_model():
    chunks, _ = build_rank(["train.precision=bf16"], rank=0, world_size=1)
    full = flat_params(chunks)
    for rank in range(4):
        chunks, ddp = build_rank(["train.precision=bf16", ZERO3, "optim.bucket_size=4000"], rank=rank, world_size=4)
        name_of = {p: n for c in chunks for n, p in c.named_parameters()}
        for buf in ddp.buffers:
            assert buf.param_data.numel() * 4 == buf.numel  # the packed slices: a quarter of the layout
        assert all(b.full.untyped_storage().size() == 0 for b in ddp.buckets)  # nothing gathered
        covered = 0
        for p, lo, hi, data in ddp.param_shards():
            assert torch.equal(data, full[name_of[p]][lo:hi]), (rank, name_of[p], lo, hi)
            covered += hi - lo
        assert covered * 4 >= sum(t.numel() for t in full.values()) * 0.9, (rank, covered)


def test_a_zero3_rank_draws_about_its_share(monkeypatch):
    """At dp=4, rank 0 draws about a quarter of the random elements (tiles cut by its flat ranges are
    drawn whole), not the whole model."""
    drawn = []
    original = torch.Tensor.normal_

    def counting_normal_(self, *args, **kwargs):
        drawn.append(self.numel())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "normal_", counting_normal_)
    chunks, _ = build_rank([*WIDE, ZERO3, "optim.bucket_size=1000000"], rank=0, world_size=4)
    full_random = sum(torch.Size(p.meta.full_shape).numel() for c in chunks for p in c.parameters()
                      if p.meta.init == "normal")
    assert 0.2 * full_random <= sum(drawn) <= 0.35 * full_random, (sum(drawn), full_random)


def test_a_one_process_zero3_model_trains_like_the_plain_one():
    """Forward and backward on the parameters the engine gathers (one rank: its slices are whole buckets)
    give the gradients of the plain model: the gathers' writes into the buckets are no change of a saved
    value to autograd."""
    grads = {}
    for level in ("none", "optim_grads_params"):
        chunks, ddp = build_rank([f"optim.sharding={level}", "optim.bucket_size=4000"], rank=0, world_size=1)
        (model,) = chunks
        ids = torch.arange(2 * 32).reshape(2, 32) % 200
        positions = torch.arange(32)
        for _ in range(2):  # a second micro-batch: gathered again after the first was freed
            model(input_ids=ids, positions=positions, labels=ids).sum().backward()
        ddp.finish_grad_sync()
        name_of = {p: n for n, p in model.named_parameters()}
        grads[level] = {name_of[p]: g.clone() for p, g in ddp.grad_pieces()}
    assert grads["none"].keys() == grads["optim_grads_params"].keys()
    for name, g in grads["none"].items():
        assert torch.allclose(grads["optim_grads_params"][name], g.reshape(-1), rtol=1e-5, atol=1e-6), name
