"""The order in which a forward pass reads the parameter buckets (the order to issue their all-gathers)."""

from __future__ import annotations


def module_params(module, borrowed: bool):
    """The parameters ``module``'s own forward reads: its direct parameters, and with ``borrowed`` those
    it lists in ``borrowed_parameters()`` (a tied output layer reading the word embedding)."""
    used = list(module.parameters(recurse=False))
    lender = getattr(module, "borrowed_parameters", None)
    return used + (list(lender()) if borrowed and callable(lender) else [])


def forward_order(chunks, bucket_of, borrowed: bool) -> list[int]:
    """Bucket indices in the order the forward pass first reads them: model chunks in order, each
    chunk's modules in the order their forwards start (a module before its submodules, those in
    registration order: embedding, layers, final norm, output layer). Buffers lay the parameters out
    in reverse, so this is roughly the reverse of the bucket order, interleaved across buffers (several
    dtypes). Collectives of one communicator run in the order they are issued (NCCL): gathers issued in
    this order let each forward start as soon as its own buckets have arrived, not after the rest."""
    order = {}
    for chunk in chunks:
        for module in chunk.modules():
            for p in module_params(module, borrowed):
                if p in bucket_of:
                    order.setdefault(bucket_of[p].index, None)
    return list(order)
