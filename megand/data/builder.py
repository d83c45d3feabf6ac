"""``build_datasets``: the train/valid/test datasets a run asks for, from the ``data`` config group.

Every input is validated before any index is built, so a bad path or value fails in seconds with a
message naming it (``DataError``).
"""

from __future__ import annotations

import numbers

import numpy as np

from megand.data.blended_dataset import BlendedDataset, samples_needed
from megand.data.errors import DataError
from megand.data.gpt_dataset import GPTDataset, samples_per_epoch
from megand.data.indexed_dataset import IndexedDataset
from megand.data.mock import MockGPTDataset
from megand.data.source import data_kind
from megand.data.token_range import check_token_ids
from megand.data.tokenizer import build_tokenizer

SPLIT_NAMES = ("train", "valid", "test")
MOCK_OFFSETS = (0, 10**9, 2 * 10**9)  # disjoint sample ranges for the mock splits


def parse_split(split) -> list[float]:
    """``"969,30,1"`` -> normalised fractions for train, valid, test (missing trailing parts are 0)."""
    try:
        parts = [float(x) for x in str(split).replace("/", ",").split(",")]
    except ValueError:
        raise DataError(f"data.split={split!r}: expected comma-separated numbers like '969,30,1'") from None
    parts = (parts + [0.0, 0.0, 0.0])[:3]
    if any(p < 0 for p in parts) or sum(parts) <= 0:
        raise DataError(f"data.split={split!r}: parts must be non-negative with a positive sum")
    return [p / sum(parts) for p in parts]


def split_ranges(num_documents: int, fractions: list[float]) -> list[tuple[int, int]]:
    """Contiguous document ranges per split, rounded as Megatron does (the last boundary is exact)."""
    bounds = [0]
    for f in fractions:
        bounds.append(bounds[-1] + int(round(f * num_documents)))
    diff = bounds[-1] - num_documents
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    bounds = [min(max(b, 0), num_documents) for b in bounds]
    return list(zip(bounds[:-1], bounds[1:]))


def parse_paths(paths) -> list[tuple[float, str]]:
    """``data.paths``: a list of ``[weight, prefix]``; weights must be >= 0 with a positive sum."""
    if not paths:
        raise DataError("data.paths is empty: give a list of [weight, prefix] pairs")
    parsed = []
    for entry in paths:
        entry = list(entry) if not isinstance(entry, str) else [entry]
        if len(entry) != 2 or not isinstance(entry[0], numbers.Real) or isinstance(entry[0], bool):
            raise DataError(f"data.paths entry {entry!r}: expected [weight, prefix]")
        if entry[0] < 0:
            raise DataError(f"data.paths entry {entry!r}: weight must be non-negative")
        parsed.append((float(entry[0]), str(entry[1])))
    total = sum(w for w, _ in parsed)
    if not total > 0:
        raise DataError(f"data.paths weights {[w for w, _ in parsed]} sum to {total}: need a positive sum")
    return parsed


def build_datasets(data_cfg, seq_length: int, vocab_size: int, seed: int,
                   num_samples: tuple[int, int, int]):
    """Return ``(train, valid, test)``; a split asked for 0 samples is ``None``. ``data.kind`` names the
    builder (:data:`megand.data.source.DATA_KINDS`)."""
    return data_kind(data_cfg.get("kind", "mock")).build(data_cfg, seq_length, vocab_size, seed, num_samples)


def build_mock(data_cfg, seq_length, vocab_size, seed, num_samples):
    """``MockGPTDataset``s on disjoint index ranges."""
    return tuple(MockGPTDataset(seq_length, vocab_size, seed, n, offset=off) if n else None
                 for n, off in zip(num_samples, MOCK_OFFSETS))


def build_quickstart(data_cfg, seq_length, vocab_size, seed, num_samples):
    """The offline corpus, built once (cached): then an indexed dataset."""
    from megand.data.quickstart import prepare_quickstart_corpus

    prefix, tokenizer = prepare_quickstart_corpus(data_cfg.get("cache_dir"), vocab_size)
    data_cfg = {**dict(data_cfg), "kind": "indexed", "paths": [[1.0, prefix]], "tokenizer": tokenizer}
    return build_indexed(data_cfg, seq_length, vocab_size, seed, num_samples)


def build_indexed(data_cfg, seq_length, vocab_size, seed, num_samples):
    """One ``GPTDataset`` per path and split (documents split by ``data.split``), blended by weight when
    there are several."""
    # --- validate everything first ---
    paths = parse_paths(data_cfg.get("paths"))
    fractions = parse_split(data_cfg.get("split", "969,30,1"))
    build_tokenizer(data_cfg, vocab_size)  # checks the vocab fits the model's embedding
    weights = [w for w, _ in paths]
    datasets = [IndexedDataset(prefix) for _, prefix in paths]  # checks files, sizes and the index
    ranges = [split_ranges(len(ds), fractions) for ds in datasets]
    for s, (name, n) in enumerate(zip(SPLIT_NAMES, num_samples)):
        if not n:
            continue
        for (w, prefix), ds, r in zip(paths, datasets, ranges):
            first, last = r[s]
            tokens = int(np.asarray(ds.sequence_lengths[first:last], dtype=np.int64).sum())
            if w > 0 and samples_per_epoch(tokens, seq_length) < 1:
                raise DataError(f"{prefix}: the {name} split (data.split={data_cfg.get('split')!r}) has "
                                f"{last - first} documents and {tokens} tokens, not enough for one sample of "
                                f"{seq_length + 1} tokens ({len(ds)} documents in the dataset)")
    for ds in datasets:  # with or without a tokenizer, the ids must fit the embedding (one scan, cached)
        check_token_ids(ds, vocab_size, data_cfg.get("cache_dir"))

    # --- build ---
    cache_dir = data_cfg.get("cache_dir")
    out = []
    for s, (name, n) in enumerate(zip(SPLIT_NAMES, num_samples)):
        if not n:
            out.append(None)
            continue
        live = [(w, ds, r[s]) for w, ds, r in zip(weights, datasets, ranges) if w > 0]
        if len(live) == 1:
            _, ds, r = live[0]
            out.append(GPTDataset(ds, r, seq_length, seed, n, cache_dir, name))
            continue
        needed = samples_needed([w for w, _, _ in live], n)
        parts = [GPTDataset(ds, r, seq_length, seed, k, cache_dir, name) for (_, ds, r), k in zip(live, needed)]
        out.append(BlendedDataset(parts, [w for w, _, _ in live], n, cache_dir, name))
    return tuple(out)


def data_tokenizer(data_cfg, vocab_size: int):
    """The tokenizer the data was made with: ``data.tokenizer`` (the quickstart corpus's own model for
    ``kind=quickstart``), or a ``NullTokenizer`` of the vocab without one."""
    if data_cfg.get("kind") == "quickstart":
        from megand.data.quickstart import prepare_quickstart_corpus

        _, tokenizer = prepare_quickstart_corpus(data_cfg.get("cache_dir"), vocab_size)  # built already: cached
        data_cfg = {**dict(data_cfg), "tokenizer": tokenizer}
    return build_tokenizer(data_cfg, vocab_size)


def eod_token_id(data_cfg, vocab_size: int) -> int:
    """The end-of-document id the data uses: ``data.eod_id`` when set, else its tokenizer's (without a
    tokenizer, the last id of the vocab, as mock data)."""
    if data_cfg.get("eod_id") is not None:
        return int(data_cfg.get("eod_id"))
    return data_tokenizer(data_cfg, vocab_size).eod_id
