"""Tokenizers: a small interface over sentencepiece, Hugging Face ``tokenizer.json`` and tiktoken files, and a
null tokenizer for mock data. Every kind reads a local file only: nothing is downloaded."""

from __future__ import annotations

import os
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

    def __init__(self, model_path: str, num_threads: int = -1, eod_id: int | None = None):
        import sentencepiece as spm

        self.model_path, self.num_threads, self._eod_arg = str(model_path), num_threads, eod_id
        try:
            self._sp = spm.SentencePieceProcessor(model_file=self.model_path, num_threads=num_threads)
        except (OSError, RuntimeError) as e:
            raise DataError(f"{self.model_path}: cannot load sentencepiece model ({e})") from e
        self.vocab_size = self._sp.vocab_size()
        self.bos_id, self.eos_id = self._sp.bos_id(), self._sp.eos_id()
        if self.eos_id < 0:
            raise DataError(f"{self.model_path}: the model has no EOS piece, needed as end-of-document")
        self.eod_id = self.eos_id if eod_id is None else eod_id

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts)

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])

    # Pickle by path: sentencepiece processors do not pickle.
    def __getstate__(self):
        return {"model_path": self.model_path, "num_threads": self.num_threads, "eod_id": self._eod_arg}

    def __setstate__(self, state):
        self.__init__(state["model_path"], state["num_threads"], state["eod_id"])


class NullTokenizer(Tokenizer):
    """For mock data: text is whitespace-separated token ids; the last id of the vocab is EOD."""

    def __init__(self, vocab_size: int):
        self.vocab_size = int(vocab_size)
        self.bos_id = self.eos_id = self.eod_id = self.vocab_size - 1

    def encode(self, text: str) -> list[int]:
        try:
            return [int(t) for t in text.split()]
        except ValueError:  # raw text reached a run that set no tokenizer (e.g. data=stream without one)
            raise DataError(f"data.tokenizer is null, so text is read as whitespace-separated token ids, but the data "
                            f"holds {' '.join(text.split())[:40]!r}: set data.tokenizer (a sentencepiece .model, "
                            f"tokenizer.json or .tiktoken file)") from None

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


# Special tokens that end a document, by tokenizer family, in the order they are looked for when the
# tokenizer does not say and no explicit id is given (GPT-2/NeoX/Qwen, Llama 3, Llama 2/Mistral, Gemma).
EOD_TOKEN_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")
BOS_TOKEN_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>")
TOKENIZER_TYPES = ("sentencepiece", "huggingface", "tiktoken")
# The split pattern of cl100k_base (also Llama 3's): a .tiktoken file holds only the ranks.
TIKTOKEN_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|"""
                    r"""\s++$|\s*[\r\n]|\s+(?!\S)|\s""")


def _first_present(vocab: dict, candidates) -> int | None:
    return next((vocab[t] for t in candidates if t in vocab), None)


class HuggingFaceTokenizer(Tokenizer):
    """A ``tokenizer.json`` through the ``tokenizers`` library. Text is encoded without special tokens
    (BOS/EOS templates are not applied: the pipeline appends EOD itself). EOD is ``eod_id`` when given,
    else the first of ``EOD_TOKEN_CANDIDATES`` in the vocabulary."""

    def __init__(self, path: str, eod_id: int | None = None):
        from tokenizers import Tokenizer as _HFTokenizer

        self.path, self._eod_arg = str(path), eod_id
        try:
            self._tok = _HFTokenizer.from_file(self.path)
        except Exception as e:  # tokenizers raises plain Exception subclasses for unreadable files
            raise DataError(f"{self.path}: cannot load tokenizer.json ({' '.join(str(e).split())})") from e
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
        found = _first_present(vocab, EOD_TOKEN_CANDIDATES)
        self.eod_id = eod_id if eod_id is not None else found
        if self.eod_id is None:
            raise DataError(f"{self.path}: no end-of-document token found (looked for "
                            f"{', '.join(EOD_TOKEN_CANDIDATES)}): give its id explicitly")
        self.eos_id = self.eod_id
        bos = _first_present(vocab, BOS_TOKEN_CANDIDATES)
        self.bos_id = self.eod_id if bos is None else bos

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __getstate__(self):
        return {"path": self.path, "eod_id": self._eod_arg}

    def __setstate__(self, state):
        self.__init__(state["path"], state["eod_id"])


class TiktokenTokenizer(Tokenizer):
    """A ``.tiktoken`` file (one ``base64(token) rank`` per line) through ``tiktoken``, split with the
    cl100k pattern. ``<|endoftext|>`` is added as a special token right after the ranks and is EOD unless
    ``eod_id`` is given. Text is encoded with ``encode_ordinary``: special-token strings in the text are
    plain text."""

    def __init__(self, path: str, eod_id: int | None = None):
        import base64

        import tiktoken

        self.path, self._eod_arg = str(path), eod_id
        ranks = {}
        try:
            with open(self.path, "rb") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    token, rank = line.split()
                    ranks[base64.b64decode(token, validate=True)] = int(rank)
        except OSError as e:
            raise DataError(f"{self.path}: cannot read tiktoken file ({e})") from e
        except ValueError as e:
            raise DataError(f"{self.path}:{lineno}: not a 'base64-token rank' line ({e})") from e
        if not ranks:
            raise DataError(f"{self.path}: empty tiktoken file")
        n = max(ranks.values()) + 1
        self._enc = tiktoken.Encoding(name=os.path.basename(self.path), pat_str=TIKTOKEN_PATTERN,
                                      mergeable_ranks=ranks, special_tokens={"<|endoftext|>": n})
        self.vocab_size = n + 1
        self.eod_id = self.eos_id = self.bos_id = n if eod_id is None else eod_id

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(texts, num_threads=1)

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids], errors="replace")

    def __getstate__(self):
        return {"path": self.path, "eod_id": self._eod_arg}

    def __setstate__(self, state):
        self.__init__(state["path"], state["eod_id"])


def infer_tokenizer_type(path: str) -> str:
    """The kind of a tokenizer file from its name: ``.model`` sentencepiece, ``.json`` Hugging Face,
    ``.tiktoken`` tiktoken."""
    name = os.path.basename(str(path))
    if name.endswith(".model"):
        return "sentencepiece"
    if name.endswith(".json"):
        return "huggingface"
    if name.endswith(".tiktoken"):
        return "tiktoken"
    raise DataError(f"{path}: cannot tell the tokenizer kind from the file name: give the tokenizer type "
                    f"({' | '.join(TOKENIZER_TYPES)})")


def load_tokenizer(path: str, tokenizer_type: str | None = None, eod_id: int | None = None,
                   num_threads: int = -1) -> Tokenizer:
    """A tokenizer of the given kind (inferred from the file name when None). ``eod_id`` overrides the
    tokenizer's own end-of-document id; ``num_threads`` bounds sentencepiece batch encoding."""
    kind = tokenizer_type or infer_tokenizer_type(path)
    if kind not in TOKENIZER_TYPES:
        raise DataError(f"tokenizer type {kind!r} is not one of {', '.join(TOKENIZER_TYPES)}")
    if not os.path.isfile(str(path)):
        raise DataError(f"{path}: tokenizer file not found")
    if kind == "sentencepiece":
        tok = SentencePieceTokenizer(path, num_threads=num_threads, eod_id=eod_id)
    elif kind == "huggingface":
        tok = HuggingFaceTokenizer(path, eod_id)
    else:
        tok = TiktokenTokenizer(path, eod_id)
    if not 0 <= tok.eod_id < tok.vocab_size:
        raise DataError(f"{path}: end-of-document id {tok.eod_id} is outside the vocabulary of {tok.vocab_size}")
    return tok


def build_tokenizer(data_cfg, vocab_size: int) -> Tokenizer:
    """``data.tokenizer`` (of kind ``data.tokenizer_type``, inferred when null) or, when null, a
    ``NullTokenizer`` of ``model.vocab_size``.

    The model's embedding must cover every id the tokenizer emits, hence the vocab-size check.
    """
    path = data_cfg.get("tokenizer")
    if not path:
        return NullTokenizer(vocab_size)
    tok = load_tokenizer(path, data_cfg.get("tokenizer_type"), data_cfg.get("eod_id"))
    if tok.vocab_size > vocab_size:
        raise DataError(f"{path}: tokenizer vocab size {tok.vocab_size} is larger than "
                        f"model.vocab_size={vocab_size}")
    return tok
