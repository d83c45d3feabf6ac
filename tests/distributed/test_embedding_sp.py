"""Under sequence parallelism the GPT embedding reduce-scatters its partial lookups over tp (no all-reduce of
the full sequence followed by a split), and gives every rank its sequence shard of the summed embedding
(word + learned position), with the gradients of the all-reduce path (one 2-rank launch)."""

import torch
import torch.distributed as dist

from megand.tools.spawn import run_distributed


def _embed(run_dir):
    import megand.core.tensor_parallel.mappings as mappings
    from megand.core.tensor_parallel import reduce_from_tp, scatter_to_sp
    from megand.training.config import compose
    from megand.training.pretrain import Trainer

    trainer = Trainer(compose(["+experiment=tiny_gpt", f"run_dir={run_dir}", "parallel.tp=2",
                               "parallel.sequence_parallel=true"]))
    topo, embedding = trainer.topo, trainer.chunks[0].embedding
    ids = torch.randint(0, trainer.cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(32)
    calls = []
    real_all_reduce, real_reduce_scatter = dist.all_reduce, mappings.reduce_scatter_flat

    def all_reduce(tensor, *args, **kwargs):
        calls.append(("all_reduce", tuple(tensor.shape)))
        return real_all_reduce(tensor, *args, **kwargs)

    def reduce_scatter_flat(out, x, *args, **kwargs):
        calls.append(("reduce_scatter", tuple(x.shape)))
        return real_reduce_scatter(out, x, *args, **kwargs)

    dist.all_reduce, mappings.reduce_scatter_flat = all_reduce, reduce_scatter_flat
    try:
        x = embedding(ids, positions)
    finally:
        dist.all_reduce, mappings.reduce_scatter_flat = real_all_reduce, real_reduce_scatter
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(6 + topo.tp_rank))
    params = [embedding.word.weight, embedding.position]
    got = torch.autograd.grad((x * grad).sum(), params)  # no data-parallel engine hooks involved

    # the reference: all-reduce of the lookups, the position rows added, then this rank's sequence shard
    full = (reduce_from_tp(embedding.word(ids), topo.tp_group) + embedding.position[positions]).transpose(0, 1)
    expected = scatter_to_sp(full.contiguous(), topo.tp_group)
    want = torch.autograd.grad((expected * grad).sum(), params)
    word_grad_ok = torch.equal(got[0], want[0])
    # the position gradient is now partial over the sequence shards: the engine sums it over tp
    position_ok = torch.equal(_summed(got[1]), want[1])
    return dict(calls=calls, same=torch.equal(x, expected), word_grad_ok=word_grad_ok, position_ok=position_ok,
                shape=tuple(x.shape), partial_flag=embedding.position.meta.partial_over_tp)


def _summed(t):
    t = t.clone()
    dist.all_reduce(t)
    return t


def test_sequence_parallel_embedding_reduce_scatters(tmp_path):
    for out in run_distributed(_embed, 2, str(tmp_path)):
        assert out["calls"] == [("reduce_scatter", (32, 2, 64))], out["calls"]
        assert out["shape"] == (16, 2, 64) and out["same"]
        assert out["word_grad_ok"] and out["position_ok"] and out["partial_flag"]
