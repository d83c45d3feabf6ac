"""An offline corpus for first runs: the standard library's pydoc topic texts, tokenized and indexed."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from megand.data.preprocess import output_prefix_for, preprocess_jsonl
from megand.data.spm_train import train_sentencepiece

_VERSION = 1


def quickstart_documents() -> list[str]:
    """Paragraphs of every pydoc topic (a few thousand documents, about 0.5 MB of English and code)."""
    from pydoc_data.topics import topics

    return [p for name in sorted(topics) for p in topics[name].split("\n\n") if p.strip()]


_TOKENIZER = "tokenizer.model"


def _root(cache_dir, vocab_size: int) -> str:
    return os.path.join(str(cache_dir), f"quickstart-v{_VERSION}-vocab{vocab_size}")


def quickstart_tokenizer(data_cfg, vocab_size: int) -> str:
    """The tokenizer a quickstart run trained on (its ``data.tokenizer`` is null: the source brings its own),
    as the run's ``data.cache_dir`` names it (relative to the launch directory when that was relative)."""
    return os.path.join(_root(data_cfg.get("cache_dir"), vocab_size), _TOKENIZER)


def prepare_quickstart_corpus(cache_dir: str, vocab_size: int = 4096) -> tuple[str, str]:
    """Build once and return ``(dataset prefix, tokenizer model path)`` under ``cache_dir``.

    Safe when several ranks call it at once: each builds in a private temporary directory and renames
    it into place; whoever loses the race discards its copy and uses the winner's.
    """
    root = _root(cache_dir, vocab_size)
    prefix_rel, model_rel = output_prefix_for("pydoc", "text"), _TOKENIZER
    if not os.path.isdir(root):
        os.makedirs(cache_dir, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".quickstart-", dir=cache_dir)
        try:
            docs = quickstart_documents()
            jsonl = os.path.join(tmp, "pydoc.jsonl")
            with open(jsonl, "w") as f:
                for d in docs:
                    f.write(json.dumps({"text": d}) + "\n")
            model = train_sentencepiece(docs, os.path.join(tmp, "tokenizer"), vocab_size, byte_fallback=True,
                                        normalization="identity")
            preprocess_jsonl(jsonl, os.path.join(tmp, "pydoc"), model, append_eod=True, workers=1, progress=False)
            os.remove(jsonl)
            try:
                os.rename(tmp, root)  # atomic; fails if another process got there first
            except OSError:
                if not os.path.isdir(root):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return os.path.join(root, prefix_rel), os.path.join(root, model_rel)
