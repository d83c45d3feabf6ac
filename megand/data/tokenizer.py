"""Tokenizers: a small interface, sentencepiece for real text, a null tokenizer for mock data."""

from __future__ import annotations

from abc import ABC, abstractmethod

from megand.data.errors import DataError


class Tokenizer(ABC):
    """What the data pipeline needs from a tokenizer. ``eod_id`` separates documents in the stream."""

    vocab_size: int
    bos_id: int
    eos_id: int
    eod_id: int

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def decode(self, ids) -> str: ...


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece ``.model``; vocab size and special ids are read from it (EOD is its EOS).

    ``num_threads`` bounds batch encoding (-1: sentencepiece uses every core).
    """

    def __init__(self, model_path: str, num_threads: int = -1):
        import sentencepiece as spm

        self.model_path, self.num_threads = str(model_path), num_threads
        try:
            self._sp = spm.SentencePieceProcessor(model_file=self.model_path, num_threads=num_threads)
        except (OSError, RuntimeError) as e:
            raise DataError(f"{self.model_path}: cannot load sentencepiece model ({e})") from e
        self.vocab_size = self._sp.vocab_size()
        self.bos_id, self.eos_id = self._sp.bos_id(), self._sp.eos_id()
        if self.eos_id < 0:
            raise DataError(f"{self.model_path}: the model has no EOS piece, needed as end-of-document")
        self.eod_id = self.eos_id

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts)

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])

    # Pickle by path: sentencepiece processors do not pickle.
    def __getstate__(self):
        return {"model_path": self.model_path, "num_threads": self.num_threads}

    def __setstate__(self, state):
        self.__init__(state["model_path"], state["num_threads"])


class NullTokenizer(Tokenizer):
    """For mock data: text is whitespace-separated token ids; the last id of the vocab is EOD."""

    def __init__(self, vocab_size: int):
        self.vocab_size = int(vocab_size)
        self.bos_id = self.eos_id = self.eod_id = self.vocab_size - 1

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


def build_tokenizer(data_cfg, vocab_size: int) -> Tokenizer:
    """``data.tokenizer`` (a ``.model`` path) or, when null, a ``NullTokenizer`` of ``model.vocab_size``.

    The model's embedding must cover every id the tokenizer emits, hence the vocab-size check.
    """
    path = data_cfg.get("tokenizer")
    if not path:
        return NullTokenizer(vocab_size)
    tok = SentencePieceTokenizer(path)
    if tok.vocab_size > vocab_size:
        raise DataError(f"{path}: tokenizer vocab size {tok.vocab_size} is larger than "
                        f"model.vocab_size={vocab_size}")
    return tok
