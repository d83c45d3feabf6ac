"""Small corpora and tokenizers shared by the data tests."""

import json

import numpy as np

from megand.data.indexed_dataset import IndexedDatasetWriter
from megand.data.quickstart import quickstart_documents
from megand.data.spm_train import train_sentencepiece


def train_small_tokenizer(directory, vocab_size=400) -> str:
    return train_sentencepiece(quickstart_documents()[:600], str(directory / "tok"), vocab_size)


def write_jsonl(path, docs, key="text") -> str:
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({key: d}) + "\n")
    return str(path)


def write_indexed(prefix, docs, dtype=np.int32) -> str:
    """Write documents (lists of ints) as an indexed dataset; returns the prefix."""
    with IndexedDatasetWriter(str(prefix), dtype) as w:
        for d in docs:
            w.add_document(np.asarray(d, dtype=np.int64))
    return str(prefix)


def unique_token_docs(lengths):
    """Documents whose tokens are their global positions: every token identifies where it came from."""
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    return [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
