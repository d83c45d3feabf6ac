"""Reading documents out of jsonl/text files, streaming, with a ``file:line: reason`` for bad lines."""

from __future__ import annotations

import json
from collections.abc import Iterator

from megand.data.errors import DataError


def parse_json_line(line: bytes | str, keys: list[str]) -> tuple[list[str] | None, str | None]:
    """Return ``(texts per key, None)`` or ``(None, reason)`` for a malformed line."""
    try:
        obj = json.loads(line)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
        return None, f"invalid JSON ({e})"
    if not isinstance(obj, dict):
        return None, f"expected a JSON object, got {type(obj).__name__}"
    texts = []
    for key in keys:
        if key not in obj:
            return None, f"missing key {key!r}"
        if not isinstance(obj[key], str):
            return None, f"key {key!r} is {type(obj[key]).__name__}, not a string"
        texts.append(obj[key])
    return texts, None


def iter_texts(paths: list[str], json_key: str = "text", on_error: str = "fail") -> Iterator[str]:
    """Texts from ``.jsonl``/``.json`` files (field ``json_key``) or plain text files (one per line)."""
    for path in paths:
        is_json = path.endswith((".jsonl", ".json"))
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if not is_json:
                    yield line.decode("utf-8", errors="replace").rstrip("\n")
                    continue
                texts, reason = parse_json_line(line, [json_key])
                if reason is not None:
                    if on_error == "fail":
                        raise DataError(f"{path}:{lineno}: {reason}")
                    continue
                yield texts[0]
