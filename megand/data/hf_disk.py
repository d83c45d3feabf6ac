"""Hugging Face ``datasets`` directories written by ``save_to_disk``, streamed (``data.kind=hf_disk``).

Such a directory holds ``state.json`` (its Arrow files, in order, under ``_data_files``) and those files, in
Arrow's IPC stream format: record batches of ``writer_batch_size`` rows (1000 by default). They are read
here by memory map with pyarrow (``datasets`` is not needed at run time). Each record batch is a unit of
the stream (:mod:`megand.data.stream`): lanes, shuffling, mixtures, state, resume and the identification
of the files read are the stream's; the text column (``data.text_key``, ``text`` by default) is tokenized
on the fly.
"""

from __future__ import annotations

import json
import os

from megand.data.errors import DataError
from megand.data.stream import TEXT_KEY, StreamSource, Unit, build_stream


def _schema_and_batches(path: str, column: str):
    """The file's schema and ``(byte offset, rows, text bytes)`` of each record batch (headers only: the
    memory map reads no column data)."""
    import pyarrow as pa

    with pa.memory_map(path) as source:
        schema = pa.ipc.open_stream(source).schema
        if column not in schema.names:
            return schema, None
        index = schema.get_field_index(column)
        source.seek(0)
        messages = pa.ipc.MessageReader.open_stream(source)
        batches = []
        while True:
            offset = source.tell()
            try:
                message = messages.read_next_message()
            except StopIteration:
                break
            if message.type == "record batch":
                batch = pa.ipc.read_record_batch(message, schema)
                batches.append((offset, batch.num_rows, batch.column(index).nbytes))
        return schema, batches


def list_units(spec: str, column: str = TEXT_KEY) -> list[Unit]:
    """The record batches of the Arrow files of one ``save_to_disk`` directory, checked readable and holding
    the string column ``column``."""
    import pyarrow as pa

    what = "data.kind=hf_disk reads a directory written by datasets' save_to_disk"
    if not os.path.isdir(spec):
        raise DataError(f"{spec}: not a directory ({what})")
    if os.path.exists(os.path.join(spec, "dataset_dict.json")):
        splits = sorted(d for d in os.listdir(spec) if os.path.isdir(os.path.join(spec, d)))
        example = "train" if "train" in splits or not splits else splits[0]
        raise DataError(f"{spec}: a DatasetDict of splits {', '.join(splits)}: give one split's directory, e.g. "
                        f"{os.path.join(spec, example)}")
    try:
        with open(os.path.join(spec, "state.json")) as f:
            files = [os.path.join(spec, entry["filename"]) for entry in json.load(f)["_data_files"]]
    except FileNotFoundError:
        raise DataError(f"{spec}: no state.json ({what})") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{spec}/state.json: cannot read its _data_files ({type(e).__name__}: {e})") from None
    if not files:
        raise DataError(f"{spec}: state.json lists no Arrow file ({what})")
    units = []
    for path in files:
        try:
            schema, batches = _schema_and_batches(path, column)
        except (OSError, pa.ArrowException) as e:  # missing, unreadable, not an Arrow stream
            raise DataError(f"{path}: cannot read Arrow ({type(e).__name__}: {' '.join(str(e).split())})") from None
        if batches is None:
            raise DataError(f"{path}: no column {column!r} (columns: {', '.join(schema.names)}; data.text_key names it)")
        kind = schema.field(column).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise DataError(f"{path}: column {column!r} is of type {kind}, not a string")
        row = 1
        for b, (offset, rows, size) in enumerate(batches):
            units.append(Unit(path, b, row, start=offset, size=size, column=column))
            row += rows
    return units


def read_unit(unit: Unit) -> list[tuple[int, object]]:
    """``(row, text or None)`` of every row of the unit's record batch, read at its offset."""
    import pyarrow as pa

    try:
        with pa.memory_map(unit.path) as source:
            schema = pa.ipc.open_stream(source).schema
            source.seek(unit.start)
            batch = pa.ipc.read_record_batch(pa.ipc.read_message(source), schema)
            values = batch.column(schema.get_field_index(unit.column)).to_pylist()
    except (OSError, ValueError, KeyError, pa.ArrowException) as e:
        raise DataError(f"{unit.path} (record batch {unit.row_group}): cannot read "
                        f"({type(e).__name__}: {' '.join(str(e).split())})") from e
    return list(enumerate(values, unit.first_row))


class HFDiskSource(StreamSource):
    """The stream of ``data.paths`` entries that are ``save_to_disk`` directories."""

    kind = "hf_disk"
    list_units = staticmethod(list_units)
    read_unit = staticmethod(read_unit)


def build_hf_disk(data_cfg, seq_length, vocab_size, seed, num_samples):
    """Train (``data.paths``) and validation (``data.valid_paths``) streams of save_to_disk directories."""
    return build_stream(data_cfg, seq_length, vocab_size, seed, num_samples, source_class=HFDiskSource)
