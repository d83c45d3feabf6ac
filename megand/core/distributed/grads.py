"""Gradient reductions that follow from how parameters are sharded.

After the last backward of a step every gradient must be the gradient of the global loss:
- over dp x cp, replicas saw different tokens: sum (the loss is already divided by the global token count);
- over tp under sequence parallelism, replicated parameters saw different sequence shards: sum;
- over a run of tp ranks sharing a key/value head (``meta.tp_replicas``), each saw its own query heads: sum;
- over the embedding group, the tied output layer of the last stage and the word embedding of the first
  stage are one parameter: sum, so both copies take the same step.
"""

import torch
import torch.distributed as dist


def _all_reduce_coalesced(tensors, group):
    """One all-reduce of all ``tensors`` (same dtype) through a flat buffer."""
    if not tensors or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset: offset + t.numel()].view_as(t))
        offset += t.numel()


def _by_dtype(tensors):
    groups = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return groups.values()


def grad_of(p):
    """The gradient the optimizer uses: the fp32 ``main_grad`` under the data-parallel engine, else ``.grad``."""
    main = getattr(p, "main_grad", None)
    return main if main is not None else p.grad


def all_reduce_layout_grads(params, topo):
    """The sequence-parallel and tied-embedding reductions (the dp reduction is the data-parallel engine's).

    ``params``: parameters (their :func:`grad_of` is reduced) or ``(param, gradient tensor)`` pairs
    (sharded gradients: the parameter's part of this rank's slices). They are sums, so they commute with
    the dp x cp sum: after a reduce-scatter (distributed optimizer) only this rank's slice of a
    ``main_grad`` is meaningful, and it stays right because tp peers lay out their buffers identically
    and the tied embedding copies have a bucket of their own on both stages.
    """
    pairs = [x if isinstance(x, tuple) else (x, grad_of(x)) for x in params]
    grads = [(p, g) for p, g in pairs if g is not None]
    if topo.tp_size > 1:
        # under expert parallelism the routed experts' tp peers may hold other experts: their gradients
        # are complete after the expert-data-parallel reduction (whose group spans the tp ranks with etp=1)
        expert_parallel = getattr(topo, "ep", 1) > 1
        tp_summed = [g for p, g in grads if p.meta.partial_over_tp
                     and not (expert_parallel and getattr(p.meta, "expert", False))]
        for same_dtype in _by_dtype(tp_summed):
            _all_reduce_coalesced(same_dtype, topo.tp_group)
        for run in sorted({p.meta.tp_replicas for p, _ in grads if p.meta.tp_replicas > 1}):
            for same_dtype in _by_dtype([g for p, g in grads if p.meta.tp_replicas == run]):
                _all_reduce_coalesced(same_dtype, topo.tp_run_group(run))
    if topo.pp_size > 1 and topo.in_embedding_group:
        for same_dtype in _by_dtype([g for p, g in grads if p.meta.embedding_group_grad]):
            _all_reduce_coalesced(same_dtype, topo.embedding_group)
    tied_local = getattr(topo, "tied_copies_on_one_rank", False)
    tied_here = [g for p, g in grads if p.meta.embedding_group_grad] if tied_local else []
    if tied_here:  # a V: the word embedding (first stage) and the output layer's copy (last) both on this rank
        word, output = tied_here
        if word.shape != output.shape:
            raise RuntimeError(f"tied embedding copies on one rank hold pieces of shapes {tuple(word.shape)} and "
                               f"{tuple(output.shape)}: they must be laid out alike")
        word.add_(output)
        output.copy_(word)
