"""Train a sentencepiece model from an iterator of documents (used by tools/train_tokenizer.py and the
quickstart corpus)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from megand.data.errors import DataError

# sentencepiece skips training sentences longer than this many bytes; documents are fed line by line.
_MAX_SENTENCE_BYTES = 16384


def _sentences(documents: Iterable[str]):
    for doc in documents:
        for line in doc.splitlines():
            if line.strip():
                yield line[:_MAX_SENTENCE_BYTES // 4]


def train_sentencepiece(documents: Iterable[str], model_prefix: str, vocab_size: int,
                        model_type: str = "bpe", character_coverage: float = 0.9995,
                        byte_fallback: bool = True, input_sentence_size: int = 0,
                        num_threads: int = 1, normalization: str = "identity") -> str:
    """Train and write ``{model_prefix}.model`` (and ``.vocab``); return the model path.

    Ids: unk 0, bos 1, eos 2 (the EOD), no pad. ``input_sentence_size`` > 0 samples that many lines.
    The defaults keep the text: ``normalization="identity"`` keeps it as is (newlines, indentation and
    runs of spaces, which matter for code) and ``byte_fallback`` spells any character outside the
    vocabulary (a newline, a rare letter) as its UTF-8 bytes, so decoding gives back exactly the text
    encoded. Sentencepiece's own default ``nmt_nfkc`` applies NFKC and folds whitespace runs into one space.
    """
    import sentencepiece as spm

    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"model_type must be bpe or unigram, got {model_type!r}")
    sentences = _sentences(documents)
    first = next(sentences, None)
    if first is None:  # sentencepiece would fail with an INTERNAL error
        raise DataError("no text to train on: the input is empty or holds only blank lines")
    spm.SentencePieceTrainer.train(
        sentence_iterator=itertools.chain([first], sentences), model_prefix=str(model_prefix),
        vocab_size=vocab_size, model_type=model_type, character_coverage=character_coverage,
        byte_fallback=byte_fallback, input_sentence_size=input_sentence_size,
        shuffle_input_sentence=input_sentence_size > 0, max_sentence_length=_MAX_SENTENCE_BYTES,
        normalization_rule_name=normalization, remove_extra_whitespaces=normalization != "identity",
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=num_threads,
        # small corpora may not support the requested size exactly; accept what they yield
        hard_vocab_limit=False, minloglevel=2)
    return f"{model_prefix}.model"
