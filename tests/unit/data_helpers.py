"""Small corpora and tokenizers shared by the data tests."""

import json

import numpy as np

from megand.data.indexed_dataset import IndexedDatasetWriter
from megand.data.quickstart import quickstart_documents
from megand.data.spm_train import train_sentencepiece


def train_small_tokenizer(directory, vocab_size=400) -> str:
    # the old lossy settings: a small vocabulary of real pieces (no 256 byte pieces) for the data tests
    return train_sentencepiece(quickstart_documents()[:600], str(directory / "tok"), vocab_size,
                               byte_fallback=False, normalization="nmt_nfkc")


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


def train_small_hf_tokenizer(directory, vocab_size=400) -> str:
    """A byte-level BPE ``tokenizer.json`` (GPT-2 style, ``<|endoftext|>`` special) trained on the quickstart text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(quickstart_documents()[:600], trainer)
    path = str(directory / "tokenizer.json")
    tok.save(path)
    return path


def write_small_tiktoken_file(directory, vocab_size=400) -> str:
    """A ``.tiktoken`` file (base64 token, rank) with tiktoken's own BPE training on the quickstart text."""
    import base64

    from tiktoken._educational import bpe_train

    from megand.data.tokenizer import TIKTOKEN_PATTERN

    ranks = bpe_train("\n".join(quickstart_documents()[:80]), vocab_size, TIKTOKEN_PATTERN, visualise=None)
    path = directory / "small.tiktoken"
    with open(path, "w") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(token).decode()} {rank}\n")
    return str(path)
