"""jsonl -> Megatron indexed datasets (``{prefix}_{key}_document.bin/.idx``), streaming, with worker processes.

Shape of a run: the main process reads the input in line chunks and writes tokens; a ``multiprocessing``
pool parses JSON and tokenizes. At most ``4 * workers`` chunks are in flight (``_Throttle``), so memory
stays bounded whatever the input size: ``Pool.imap`` alone would read the whole file ahead of the workers.
``partitions > 1`` splits the file into line-aligned byte ranges processed by separate processes (each
with its own reader, writer and share of the workers) and merges their outputs at the end.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import itertools
import multiprocessing as mp
import os
import sys
from queue import Empty
import threading
import time
import zlib

import numpy as np
from tqdm import tqdm

from megand.data.errors import DataError
from megand.data.indexed_dataset import IndexedDatasetWriter, bin_path, idx_path, merge_datasets, token_dtype
from megand.data.jsonl import file_kind, parse_json_line
from megand.data.tokenizer import Tokenizer, load_tokenizer

CHUNK_BYTES = 1 << 20

# Spawned, not forked, workers: a fork of a process that already runs threads (torch, tqdm, a test
# runner) can inherit a held lock and hang; spawned workers start clean.
_MP = mp.get_context("spawn")
_MAX_REPORTED_ERRORS = 20


@dataclasses.dataclass
class PreprocessSummary:
    documents: int = 0   # documents written, summed over keys
    empty: int = 0       # documents skipped because they tokenized to nothing
    bad_lines: int = 0   # malformed lines skipped (--on-error=skip)
    bytes: int = 0       # input bytes read
    tokens: int = 0      # tokens written, EOD included
    seconds: float = 0.0

    def __add__(self, other: "PreprocessSummary") -> "PreprocessSummary":
        merged = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)}
        merged["seconds"] = max(self.seconds, other.seconds)  # partitions run concurrently
        return PreprocessSummary(**merged)

    def describe(self) -> str:
        s = max(self.seconds, 1e-9)
        return (f"{self.documents} documents, {self.tokens} tokens from {self.bytes / 1e6:.1f} MB in {s:.1f} s "
                f"({self.bytes / 1e6 / s:.2f} MB/s, {self.tokens / s:.0f} tokens/s); "
                f"skipped {self.empty} empty documents and {self.bad_lines} malformed lines")


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron's naming: one dataset per json key."""
    return f"{output_prefix}_{key}_document"


# ---- inputs ------------------------------------------------------------------------------------------
INPUT_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
PARQUET_BATCH_ROWS = 64  # rows converted to Python at a time: a few of them make a chunk


def expand_inputs(spec: str) -> list[str]:
    """``--input``: a file, a directory (its .jsonl/.jsonl.gz/.parquet files) or a glob, sorted by name."""
    if os.path.isdir(spec):
        paths = [os.path.join(spec, n) for n in os.listdir(spec)]
    elif glob.has_magic(spec):
        paths = glob.glob(spec)
    else:
        if not os.path.isfile(spec):
            raise DataError(f"{spec}: input file not found")
        # one named file: JSON lines unless it ends with .parquet (.gz: compressed); binary input or Parquet
        # under another name is refused, naming the file
        if file_kind(spec) == "parquet" and not spec.endswith(".parquet"):
            raise DataError(f"{spec}: a Parquet file not named .parquet: rename it to end with .parquet")
        return [spec]
    paths = sorted(p for p in paths if os.path.isfile(p) and p.endswith(INPUT_SUFFIXES))
    if not paths:
        raise DataError(f"{spec}: no {', '.join(INPUT_SUFFIXES)} files there")
    return paths


# ---- worker side -------------------------------------------------------------------------------------
# Each pool worker loads the tokenizer once (pool initializer); this module-level slot is per process.
_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer_spec: tuple) -> None:
    global _worker_tokenizer
    path, kind, eod_id = tokenizer_spec
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # Hugging Face batches: one thread per worker
    _worker_tokenizer = load_tokenizer(path, kind, eod_id, num_threads=1)  # one core per worker


def _json_rows(first_lineno, lines, keys):
    """``(texts per key | None, reason | None, line number)`` of each non-blank line."""
    for lineno, line in enumerate(lines, first_lineno):
        if line.strip():  # blank lines (e.g. a trailing newline) are not documents
            values, reason = parse_json_line(line, keys)
            yield values, reason, lineno


def _column_rows(first_row, columns, keys):
    """The same for Parquet: ``columns`` holds one list of values per key."""
    for i, values in enumerate(zip(*columns)):
        bad = next(((k, v) for k, v in zip(keys, values) if not isinstance(v, str)), None)
        if bad is None:
            yield list(values), None, first_row + i
        else:
            kind = "null" if bad[1] is None else f"{type(bad[1]).__name__}, not a string"
            yield None, f"column {bad[0]!r} is {kind}", first_row + i


def _encode_chunk(task):
    """Parse and tokenize one chunk of rows. Returns per-key (tokens, lengths), errors, counts."""
    kind, first_row, payload, nbytes, keys, append_eod = task
    tok = _worker_tokenizer
    texts = [[] for _ in keys]
    errors = []
    rows = _json_rows(first_row, payload, keys) if kind == "json" else _column_rows(first_row, payload, keys)
    for values, reason, rowno in rows:
        if reason is not None:
            errors.append((rowno, reason))
            continue
        for bucket, value in zip(texts, values):
            bucket.append(value)
    per_key, empty = [], 0
    for bucket in texts:
        ids = [x for x in tok.encode_batch(bucket) if x]
        empty += len(bucket) - len(ids)
        if append_eod:
            ids = [x + [tok.eod_id] for x in ids]
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))
        per_key.append((flat, lengths))
    return per_key, errors, empty, nbytes


# ---- main side ---------------------------------------------------------------------------------------
class _Throttle:
    """Bounds the chunks in flight; ``stop()`` releases a reader blocked on it so the pool can shut down."""

    def __init__(self, slots: int):
        self._sem, self._stopped = threading.Semaphore(slots), threading.Event()

    def acquire(self) -> bool:
        self._sem.acquire()
        return not self._stopped.is_set()

    def release(self) -> None:
        self._sem.release()

    def stop(self) -> None:
        self._stopped.set()
        self._sem.release()


def _read_json_chunks(path, start, end, first_lineno, throttle):
    """``(kind, first line number, lines, bytes)`` chunks of byte range ``[start, end)``; ``end=None``: to EOF
    (a .jsonl.gz is read whole, decompressed on the fly)."""
    gz = path.endswith(".gz")
    with (gzip.open(path, "rb") if gz else open(path, "rb")) as f:
        if not gz:
            f.seek(start)
        pos, lineno = start, first_lineno
        while end is None or pos < end:
            if not throttle.acquire():
                return
            lines, size = [], 0
            while size < CHUNK_BYTES and (end is None or pos + size < end):
                try:
                    line = f.readline()
                except (OSError, EOFError, zlib.error) as e:  # a truncated or corrupt .gz: name the file
                    raise DataError(f"{path}: cannot decompress after line {lineno + len(lines) - 1} "
                                    f"({type(e).__name__}: {' '.join(str(e).split()) or 'truncated'})") from None
                if not line:
                    break
                lines.append(line)
                size += len(line)
            if not lines:
                throttle.release()
                return
            pos += size
            yield "json", lineno, lines, size
            lineno += len(lines)


def _read_parquet_chunks(path, keys, throttle):
    """``(kind, first row number, columns, text bytes)`` chunks of about ``CHUNK_BYTES`` of text, read a
    batch of rows at a time out of one row group at a time, so memory holds one row group's decoded
    columns at most (Parquet decompresses a column chunk whole)."""
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path, pre_buffer=False)  # read column chunks as needed, not whole row groups ahead
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a corrupt or non-Parquet file
        raise DataError(f"{path}: cannot read Parquet ({' '.join(str(e).split())})") from e
    names = pf.schema_arrow.names
    missing = [k for k in keys if k not in names]
    if missing:
        raise DataError(f"{path}: no column {', '.join(map(repr, missing))} (columns: {', '.join(names)})")
    row, columns, size = 1, [[] for _ in keys], 0
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=keys, use_threads=False):
        values = [batch.column(k).to_pylist() for k in keys]
        for col, vals in zip(columns, values):
            col.extend(vals)
        size += sum(len(v.encode("utf-8")) for vals in values for v in vals if isinstance(v, str))
        del batch, values
        if size >= CHUNK_BYTES:
            if not throttle.acquire():
                return
            yield "columns", row, columns, size
            row += len(columns[0])
            columns, size = [[] for _ in keys], 0
    if columns[0]:
        if throttle.acquire():
            yield "columns", row, columns, size


def _chunks(path, start, end, first_lineno, keys, append_eod, throttle):
    """Tasks for the pool out of one input file (or a byte range of a .jsonl)."""
    reader = (_read_parquet_chunks(path, keys, throttle) if path.endswith(".parquet")
              else _read_json_chunks(path, start, end, first_lineno, throttle))
    for kind, first, payload, nbytes in reader:
        yield kind, first, payload, nbytes, keys, append_eod


def _process_range(sources, out_prefix, tokenizer_spec, keys, append_eod, workers, on_error, position=0,
                   progress=True) -> PreprocessSummary:
    """Tokenize ``sources`` (``(path, start, end, first line)`` each; ``end=None``: the whole file) in order
    into ``{out_prefix}_{key}_document``."""
    vocab = load_tokenizer(*tokenizer_spec).vocab_size
    prefixes = [output_prefix_for(out_prefix, k) for k in keys]
    writers = [IndexedDatasetWriter(p, token_dtype(vocab)) for p in prefixes]
    summary, reported = PreprocessSummary(), 0
    throttle = _Throttle(4 * workers)
    t0 = time.perf_counter()
    pool = _MP.Pool(workers, initializer=_init_worker, initargs=(tokenizer_spec,))
    bar = None
    try:
        for path, start, end, first_lineno in sources:
            total = os.path.getsize(path) - start if end is None else end - start
            bar = tqdm(total=total, unit="B", unit_scale=True, desc=os.path.basename(path), position=position,
                       disable=not progress or path.endswith(".parquet"), mininterval=1.0, smoothing=0.1)
            chunks = _chunks(path, start, end, first_lineno, keys, append_eod, throttle)
            for per_key, errors, empty, nbytes in pool.imap(_encode_chunk, chunks):
                throttle.release()
                for rowno, reason in errors:
                    message = f"{path}:{rowno}: {reason}"
                    if on_error == "fail":
                        raise DataError(message)
                    if reported < _MAX_REPORTED_ERRORS:
                        tqdm.write(f"skipping {message}", file=sys.stderr)
                    reported += 1
                for writer, (flat, lengths) in zip(writers, per_key):
                    writer.add_documents(flat, lengths)
                    summary.documents += len(lengths)
                    summary.tokens += len(flat)
                summary.empty += empty
                summary.bad_lines += len(errors)
                summary.bytes += nbytes
                bar.update(nbytes)
            bar.close()
        for w in writers:
            w.finalize()
    except BaseException:
        throttle.stop()
        pool.terminate()
        for w in writers:  # leave no half-written dataset behind
            w.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
        pool.close()
        pool.join()
    if reported > _MAX_REPORTED_ERRORS:
        tqdm.write(f"... and {reported - _MAX_REPORTED_ERRORS} more malformed rows", file=sys.stderr)
    summary.seconds = time.perf_counter() - t0
    return summary


def _partition_bounds(path: str, partitions: int) -> list[tuple[int, int, int]]:
    """Split a file into line-aligned ``(start, end, first_lineno)`` byte ranges."""
    size = os.path.getsize(path)
    starts = {0}
    with open(path, "rb") as f:
        for k in range(1, partitions):
            f.seek(k * size // partitions)
            f.readline()  # move to the start of the next line
            if f.tell() < size:
                starts.add(f.tell())
    starts = sorted(starts)
    # Line numbers of the starts: count newlines in one streaming pass.
    linenos, count, pos = [], 1, 0
    with open(path, "rb") as f:
        for s in starts:
            while pos < s:
                block = f.read(min(16 << 20, s - pos))
                count += block.count(b"\n")
                pos += len(block)
            linenos.append(count)
    ends = starts[1:] + [size]
    return list(zip(starts, ends, linenos))


def _partition_main(queue, *args, **kwargs):
    try:
        queue.put(("ok", _process_range(*args, **kwargs)))
    except DataError as e:
        queue.put(("error", str(e)))
    except BaseException as e:  # anything else: report it rather than hang the parent
        queue.put(("error", f"{type(e).__name__}: {e}"))


def _collect(queue, procs) -> list:
    """One result per partition process; an error instead of a hang if one dies without reporting."""
    results = []
    while len(results) < len(procs):
        try:
            results.append(queue.get(timeout=1.0))
        except Empty:
            if not any(p.is_alive() for p in procs):
                try:
                    results.append(queue.get(timeout=1.0))  # a last report still in the pipe
                except Empty:
                    codes = [p.exitcode for p in procs]
                    raise DataError(f"a partition process exited without a result (exit codes {codes})") from None
    for p in procs:
        p.join()
    return results


def preprocess_jsonl(input_path: str, output_prefix: str, tokenizer_model: str, json_keys=("text",),
                     append_eod: bool = False, workers: int = 1, partitions: int = 1, on_error: str = "fail",
                     progress: bool = True, tokenizer_type: str | None = None,
                     eod_id: int | None = None) -> PreprocessSummary:
    """Tokenize JSON lines / Parquet input (a file, a directory or a glob, see ``expand_inputs``) into one
    indexed dataset per key, documents in file-name then row order; returns counts and timing.

    Everything is written under private names next to the output and renamed into place only once every
    dataset is complete, so a failed or interrupted run leaves an existing dataset of the same prefix as
    it was. The output directory is created when missing."""
    keys = list(json_keys)
    if on_error not in ("fail", "skip"):
        raise ValueError(f"on_error must be fail or skip, got {on_error!r}")
    inputs = expand_inputs(input_path)
    if partitions > 1 and (len(inputs) > 1 or inputs[0].endswith((".gz", ".parquet"))):
        raise DataError(f"--partitions {partitions} needs a single uncompressed JSON lines input, got {input_path}")
    tokenizer_spec = (tokenizer_model, tokenizer_type, eod_id)
    load_tokenizer(*tokenizer_spec)  # fail early on a bad tokenizer
    os.makedirs(os.path.dirname(output_prefix) or ".", exist_ok=True)
    staging = f"{output_prefix}.tmp{os.getpid()}"
    try:
        summary = _preprocess(inputs, staging, tokenizer_spec, keys, append_eod, workers, partitions, on_error,
                              progress)
        if summary.documents == 0:  # an empty dataset would only fail later, at training time
            raise DataError(f"{input_path}: no documents to write ({summary.empty} empty, {summary.bad_lines} "
                            f"malformed skipped): the input holds no text under {', '.join(map(repr, keys))}")
        for key in keys:  # publish: every dataset is complete
            for path_of in (bin_path, idx_path):
                os.replace(path_of(output_prefix_for(staging, key)), path_of(output_prefix_for(output_prefix, key)))
    finally:
        for key in keys:
            _remove_dataset(output_prefix_for(staging, key))
    return summary


def _remove_dataset(prefix: str) -> None:
    for f in (bin_path(prefix), idx_path(prefix)):
        if os.path.exists(f):
            os.remove(f)


def _preprocess(inputs, output_prefix, tokenizer_spec, keys, append_eod, workers, partitions, on_error,
                progress) -> PreprocessSummary:
    common = (tokenizer_spec, keys, append_eod)
    if partitions <= 1:
        sources = [(path, 0, None, 1) for path in inputs]
        return _process_range(sources, output_prefix, *common, max(1, workers), on_error, progress=progress)
    bounds = _partition_bounds(inputs[0], partitions)
    part_prefixes = [f"{output_prefix}_part{k}" for k in range(len(bounds))]
    per_part = max(1, workers // len(bounds))
    queue = _MP.Queue()
    procs = [_MP.Process(target=_partition_main,
                        args=(queue, [(inputs[0], *b)], pp, *common, per_part, on_error),
                        kwargs=dict(position=k, progress=progress))
             for k, (b, pp) in enumerate(zip(bounds, part_prefixes))]
    for p in procs:
        p.start()
    results = _collect(queue, procs)
    try:
        errors = [msg for status, msg in results if status == "error"]
        if errors:
            raise DataError(errors[0])
        for key in keys:
            merge_datasets([output_prefix_for(pp, key) for pp in part_prefixes], output_prefix_for(output_prefix, key))
    finally:
        for pp in part_prefixes:
            for key in keys:
                _remove_dataset(output_prefix_for(pp, key))
    total = PreprocessSummary()
    for _, s in results:
        total = total + s
    return total
