"""Reading documents out of jsonl (optionally gzipped), Parquet or plain-text files, streaming, with a
``file:line: reason`` for bad lines. Binary files are refused rather than read as text."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator

from megand.data.errors import DataError

PARQUET_MAGIC, GZIP_MAGIC = b"PAR1", b"\x1f\x8b"
_SNIFF_BYTES = 1 << 16


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


def file_kind(path: str) -> str:
    """``parquet``, ``jsonl`` (``.gz`` too) or ``text``, from the file's first bytes as well as its name: a
    Parquet or gzip file is recognised whatever it is called, and any other file that is not UTF-8 text
    (NUL bytes, invalid UTF-8) is refused, naming it."""
    with open(path, "rb") as f:
        head = f.read(_SNIFF_BYTES)
    if head.startswith(PARQUET_MAGIC):
        return "parquet"
    if head.startswith(GZIP_MAGIC):
        if not path.endswith((".jsonl.gz", ".json.gz")):
            raise DataError(f"{path}: a gzip file not named .jsonl.gz: only gzipped JSON lines are read")
        return "jsonl"
    if b"\0" in head:
        raise DataError(f"{path}: binary file (NUL bytes), not text, JSON lines or Parquet")
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 4:  # not just a character cut at the end of the sniffed block
            raise DataError(f"{path}: not UTF-8 text (invalid byte at offset {e.start}); "
                            f"give JSON lines, Parquet or UTF-8 text") from None
    return "jsonl" if path.endswith((".jsonl", ".json")) else "text"


def _parquet_texts(path: str, key: str, on_error: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # ArrowInvalid / OSError for a corrupt file
        raise DataError(f"{path}: cannot read Parquet ({' '.join(str(e).split())})") from e
    names = pf.schema_arrow.names
    if key not in names:
        raise DataError(f"{path}: no column {key!r} (columns: {', '.join(names)}); name it with --json-keys")
    row = 0
    for batch in pf.iter_batches(batch_size=1024, columns=[key]):
        for value in batch.column(0).to_pylist():
            row += 1
            if isinstance(value, str):
                yield value
            elif on_error == "fail":
                kind = "null" if value is None else f"{type(value).__name__}, not a string"
                raise DataError(f"{path}:{row}: column {key!r} is {kind}")


def iter_texts(paths: list[str], json_key: str = "text", on_error: str = "fail") -> Iterator[str]:
    """Texts from ``.jsonl``/``.json``/``.jsonl.gz`` files (field ``json_key``), Parquet files (column
    ``json_key``) or plain UTF-8 text files (one per line)."""
    for path in paths:
        kind = file_kind(path)
        if kind == "parquet":
            yield from _parquet_texts(path, json_key, on_error)
            continue
        with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as f:
            try:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    if kind == "text":
                        yield line.decode("utf-8", errors="replace").rstrip("\n")
                        continue
                    texts, reason = parse_json_line(line, [json_key])
                    if reason is not None:
                        if on_error == "fail":
                            raise DataError(f"{path}:{lineno}: {reason}")
                        continue
                    yield texts[0]
            except (OSError, EOFError) as e:  # a truncated or corrupt .gz
                raise DataError(f"{path}: cannot read ({' '.join(str(e).split())})") from None
