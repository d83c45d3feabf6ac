"""Streaming raw corpora: JSON lines (``.jsonl``, ``.jsonl.gz``) and Parquet files with a ``text`` field,
tokenized on the fly and packed into samples, with a state that a checkpoint keeps (``data.kind=stream``).

The global stream does not depend on the parallel layout. A global batch of ``B`` samples has ``B``
*lanes*: lane ``l`` fills slot ``l`` of every global batch with its own packed stream of documents, and
data-parallel rank ``r`` of ``dp`` owns the lanes of its slice of the batch, ``[r*B/dp, (r+1)*B/dp)``.
So iteration ``i`` trains on the same tokens at every ``dp`` (and tp/cp/pp), and a checkpoint holds every
lane's position: resumed at another ``dp``, each rank takes the positions of its lanes, and no document
is repeated or skipped.

Where lane ``l`` reads from: every source of ``data.paths`` is a list of *units*: a ``.jsonl.gz`` file, a
``.jsonl`` file cut into chunks of at most ``CHUNK_BYTES`` at line starts, or one row group of a Parquet
file. Each epoch of a source visits its units in an order shuffled by ``(seed, source, epoch)``. When a
source has fewer units than lanes, each unit is cut into ``c = ceil(B / units)`` *pieces* (rows
``j, j+c, ...`` of the unit, for piece ``j``), otherwise a piece is a whole unit. The piece at position
``p`` of the epoch belongs to lane ``p mod B``, which reads its pieces in order, the rows of each in an
order shuffled by ``(seed, source, epoch, unit)`` (the unit is the shuffle buffer). So every document of
an epoch belongs to exactly one lane, and a reader reads only the units of its own lanes: its cost is its
share of the corpus (the pieces of one unit fall on consecutive lanes, mostly one reader's). With several
sources, a lane takes its next document from the source furthest behind its weight in characters of text
read (weights are shares of text, about shares of tokens).

A lane's samples are its documents' tokens, each document followed by the EOD id, cut into
``seq_length + 1`` token windows that overlap by one token (the last label of one sample is the first
input of the next, as for indexed data). Its state is where the document it is inside starts (the
cursors and characters read of every source before it) and the token offset there.

A reader tokenizes its lanes' documents in ``data.workers`` worker processes.

The state also identifies the files: every file of every source with its size and modification time,
and a hash of the rows of every unit read. A resume on files that changed since (a file added, removed,
grown, or modified where it was read) is refused before training, naming the file and the change: the
lanes' positions would otherwise point at other documents, repeating or skipping some.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import multiprocessing as mp
import os
from collections import OrderedDict, deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

import numpy as np

from megand.data.errors import DataError

TOKENIZE_AHEAD = 4  # samples per lane tokenized in one round trip to the worker processes
UNIT_CACHE = 4  # units (decoded rows) a reader keeps beyond one per lane (neighbouring lanes share small units)
CHUNK_BYTES = 32 << 20  # a .jsonl file is read in units of at most this many bytes (a .jsonl.gz one whole)
TEXT_KEY = "text"  # the default field / column of each document's text (data.text_key)
STATE_VERSION = 3  # of the state's meaning (2: whole units per lane; 3: the files read are identified)


@dataclass(frozen=True)
class Unit:
    path: str
    row_group: int | None  # a Parquet row group; None: JSON lines
    first_row: int = 1  # the file's row number of the unit's first row (Parquet)
    start: int = 0  # JSON lines: the unit holds the lines that start in bytes [start, end) of the file
    end: int | None = None  # None: to the end of the file
    size: int = 0  # bytes read from storage to read the unit (compressed: the file's or column chunk's size)
    column: str = TEXT_KEY  # the JSON field or column holding the text


def list_units(spec: str, column: str = TEXT_KEY) -> list[Unit]:
    """The units of one ``data.paths`` entry (a directory, a glob or a file), checked readable, whose text
    is the field or column ``column``. Only file sizes and Parquet footers are read."""
    from megand.data.preprocess import expand_inputs

    units = []
    for path in expand_inputs(spec):
        if not os.access(path, os.R_OK):
            raise DataError(f"{path}: not readable (permission denied)")
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            try:
                meta = pq.ParquetFile(path).metadata
                names = meta.schema.to_arrow_schema().names
            except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a corrupt or non-Parquet file
                raise DataError(f"{path}: cannot read Parquet ({' '.join(str(e).split())})") from e
            if column not in names:
                raise DataError(f"{path}: no column {column!r} (columns: {', '.join(names)}; data.text_key names it)")
            leaves = meta.schema.names  # the column chunk of `text` is what a read fetches
            leaf = leaves.index(column) if column in leaves else None
            row = 1
            for g in range(meta.num_row_groups):
                group = meta.row_group(g)
                size = group.total_byte_size if leaf is None else group.column(leaf).total_compressed_size
                units.append(Unit(path, g, row, size=size, column=column))
                row += group.num_rows
        elif path.endswith(".gz"):  # a gzip stream cannot be entered in the middle
            units.append(Unit(path, None, size=os.path.getsize(path), column=column))
        else:
            size = os.path.getsize(path)
            n = max(1, -(-size // CHUNK_BYTES))
            bounds = [size * i // n for i in range(n + 1)]
            units += [Unit(path, None, start=a, end=None if i == n - 1 else b, size=b - a, column=column)
                      for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    return units


def _read_lines(unit: Unit) -> list[tuple[object, bytes]]:
    """``(row, line)`` of the lines that start in the unit's byte range; ``row`` is the line number in the
    file when the unit starts the file, else ``"byte N"`` (the line's offset: line numbers would need the
    bytes before it)."""
    if unit.path.endswith(".gz"):
        with gzip.open(unit.path, "rb") as f:
            return list(enumerate(f, 1))
    out = []
    with open(unit.path, "rb") as f:
        if unit.start > 0:
            f.seek(unit.start - 1)
            if f.read(1) != b"\n":
                f.readline()  # the line under way belongs to the unit before
        pos = f.tell()
        n = 0
        while unit.end is None or pos < unit.end:
            line = f.readline()
            if not line:
                break
            n += 1
            out.append((n if unit.start == 0 else f"byte {pos}", line))
            pos += len(line)
    return out


def read_unit(unit: Unit) -> list[tuple[object, object]]:
    """``(row, raw row)`` of every non-blank row: bytes of a JSON line, or a Parquet value."""
    try:
        if unit.row_group is None:
            return [(n, line) for n, line in _read_lines(unit) if line.strip()]
        import pyarrow.parquet as pq

        values = pq.ParquetFile(unit.path).read_row_group(unit.row_group, columns=[unit.column]).column(0).to_pylist()
        return list(enumerate(values, unit.first_row))
    except (OSError, EOFError, ValueError) as e:  # also gzip's BadGzipFile, pyarrow's ArrowInvalid
        where = unit.path if unit.row_group is None else f"{unit.path} (row group {unit.row_group})"
        raise DataError(f"{where}: cannot read ({type(e).__name__}: {' '.join(str(e).split())})") from e


def parse_row(unit: Unit, raw) -> tuple[str | None, str | None]:
    """``(text, None)`` or ``(None, reason)``."""
    if unit.row_group is None:
        from megand.data.jsonl import parse_json_line

        texts, reason = parse_json_line(raw, [unit.column])
        return (None, reason) if reason else (texts[0], None)
    if not isinstance(raw, str):
        return None, f"column {unit.column!r} is {'null' if raw is None else type(raw).__name__ + ', not a string'}"
    return raw, None


# ---- tokenizing: in worker processes, or in the reader when data.workers=0 ---------------------------------
def tokenizer_spec(data_cfg, vocab_size: int) -> tuple:
    """What a worker needs to load the run's tokenizer (a null tokenizer without ``data.tokenizer``)."""
    return (data_cfg.get("tokenizer"), data_cfg.get("tokenizer_type"), data_cfg.get("eod_id"), vocab_size)


def _load_tokenizer(spec):
    from megand.data.tokenizer import NullTokenizer, load_tokenizer

    path, kind, eod_id, vocab_size = spec
    if not path:
        return NullTokenizer(vocab_size)
    return load_tokenizer(path, kind, eod_id, num_threads=1)


@functools.lru_cache(maxsize=1)
def _worker_tokenizer(spec):
    """A worker process's tokenizer, loaded by the pool's initializer and kept for the tasks that name the
    same ``spec`` (a worker serves one stream: one entry; another spec loads its own)."""
    return _load_tokenizer(spec)


def _init_worker(spec) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _worker_tokenizer(spec)


def _encode_in_worker(spec, texts: list[str]) -> list[np.ndarray]:
    return _encode(_worker_tokenizer(spec), texts)


def _encode(tok, texts: list[str]) -> list[np.ndarray]:
    """Each text's ids under ``tok`` followed by the EOD id (an empty document: empty, and dropped by the
    lane)."""
    batch = tok.encode_batch(texts) if hasattr(tok, "encode_batch") else [tok.encode(t) for t in texts]
    return [np.asarray([*ids, tok.eod_id], dtype=np.int64) if len(ids) else np.zeros(0, np.int64) for ids in batch]


@dataclass
class Document:
    before: dict  # the lane's selection state before this document was taken
    where: str  # file:row
    epoch: int  # of its source
    tokens: np.ndarray | None = None


class Lane:
    """One slot of every global batch: its documents, tokenized, packed into overlapping windows."""

    def __init__(self, index: int, stream: "StreamSource"):
        self.index, self.stream = index, stream
        n = len(stream.sources)
        self.cursors = [[0, index, 0] for _ in range(n)]  # [epoch, piece position, row in the piece] per source
        self.chars = [0] * n  # characters of text taken from each source
        self.docs: deque[Document] = deque()  # taken, in order; docs[0] holds the next sample's first token
        self.offset = 0  # that token's index in docs[0]

    # -- state
    def selection_state(self) -> dict:
        return {"cursors": [list(c) for c in self.cursors], "chars": list(self.chars)}

    def state_dict(self) -> dict:
        if self.docs:
            return {**self.docs[0].before, "offset": self.offset}
        return {**self.selection_state(), "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.cursors = [list(map(int, c)) for c in state["cursors"]]
        self.chars = [int(c) for c in state["chars"]]
        self.offset = int(state["offset"])
        self.docs.clear()

    # -- taking documents
    def next_source(self) -> int:
        total = sum(self.chars) + 1
        weights = self.stream.weights
        return max(range(len(weights)), key=lambda s: (weights[s] * total - self.chars[s], -s))

    def take(self) -> tuple[Document, str]:
        """The next document of this lane (its text still to tokenize)."""
        before = self.selection_state()
        s = self.next_source()
        cursor = self.cursors[s]
        pieces = self.stream.pieces(s)
        passed = 0  # pieces passed without a document
        while True:
            epoch, position, row = cursor
            if position >= pieces:
                cursor[:] = [epoch + 1, self.index, 0]
                continue
            unit, rows = self.stream.piece_rows(s, epoch, position)
            if row >= len(rows):
                passed += 1
                if passed > 2 * (pieces // self.stream.lanes + 1):
                    skipped = f", {self.stream.skipped} malformed row(s) skipped" if self.stream.skipped else ""
                    raise DataError(f"data.paths entry {self.stream.specs[s]!r}: stream lane {self.index} found no "
                                    f"document in two epochs of its share of the {len(self.stream.sources[s])} "
                                    f"unit(s) (files, chunks of files and Parquet row groups{skipped}): the stream "
                                    f"is empty, or has not clearly more documents than the {self.stream.lanes} "
                                    f"lanes (train.global_batch_size)")
                cursor[:] = [epoch, position + self.stream.lanes, 0]
                continue
            cursor[2] = row + 1
            rowno, raw = rows[row]
            text, reason = self.stream.parse_row(unit, raw)
            where = f"{unit.path}:{rowno}"
            if reason is not None:
                if self.stream.on_error == "fail":
                    raise DataError(f"{where}: {reason} (data.on_error=skip skips malformed rows)")
                self.stream.note_skipped(where, reason)
                continue
            self.chars[s] += len(text)
            doc = Document(before, where, epoch)
            if self.stream.history is not None:
                self.stream.history.setdefault(self.index, []).append(doc)
            return doc, text

    def buffered(self) -> int:
        """Tokens available from the next sample's first token on (documents not yet tokenized: none)."""
        count = -self.offset
        for doc in self.docs:
            if doc.tokens is None:
                return count
            count += len(doc.tokens)
        return count

    def sample(self, seq_length: int) -> np.ndarray:
        """The next ``seq_length + 1`` tokens (:meth:`buffered` must cover them); the lane moves on by
        ``seq_length``."""
        out, need, k, start = [], seq_length + 1, 0, self.offset
        while need > 0:
            tokens = self.docs[k].tokens[start:start + need]
            out.append(tokens)
            need -= len(tokens)
            k, start = k + 1, 0
        advance = seq_length
        while advance >= len(self.docs[0].tokens) - self.offset:
            advance -= len(self.docs[0].tokens) - self.offset
            self.docs.popleft()
            self.offset = 0
        self.offset += advance
        return np.concatenate(out)


def rows_digest(rows) -> str:
    """A hash of a unit's rows as read (bytes of JSON lines, or column values)."""
    h = hashlib.blake2b(digest_size=8)
    for _, raw in rows:
        data = raw if isinstance(raw, bytes) else b"\xff" if raw is None else str(raw).encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def file_identity(path: str) -> list[int]:
    """``[size, modification time in ns]`` of a file."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns]


def merge_states(states: list[dict]) -> dict:
    """One stream state from the readers' states (each holds its own lanes and the units it read)."""
    merged = dict(states[0])
    merged["lane_states"] = {str(k): v for s in states for k, v in s["lane_states"].items()}
    merged["read"] = [{k: v for s in states for k, v in s["read"][i].items()} for i in range(len(states[0]["read"]))]
    return merged


class StreamSource:
    """The stream of ``data.paths``; a reader :meth:`open` s the lanes of one data-parallel rank.

    The files of one source and how they are read (:meth:`list_units`, :meth:`read_unit`, :meth:`parse_row`):
    JSON lines and Parquet here; a subclass reads another format through the same lanes and state."""

    kind = "stream"  # the data.kind whose state this is
    list_units = staticmethod(list_units)  # (spec, text column) -> the units of one data.paths entry, checked readable
    read_unit = staticmethod(read_unit)  # unit -> [(row number, raw row)]
    parse_row = staticmethod(parse_row)  # (unit, raw row) -> (text, None) or (None, reason)

    def __init__(self, data_cfg, seq_length: int, vocab_size: int, seed: int):
        from megand.data.builder import parse_paths
        from megand.data.tokenizer import build_tokenizer

        paths = parse_paths(data_cfg.get("paths"))
        self.specs = [spec for w, spec in paths if w > 0]
        total = sum(w for w, _ in paths)
        self.weights = [w / total for w, _ in paths if w > 0]
        self.text_key = data_cfg.get("text_key") or TEXT_KEY
        self.sources = [self.list_units(spec, self.text_key) for spec in self.specs]
        # each source's files: {path: [size, mtime_ns]}, and the hash of every unit read (by unit index)
        self.files = [{u.path: file_identity(u.path) for u in units} for units in self.sources]
        self.read_digests: list[dict[str, str]] = [{} for _ in self.sources]
        self.tokenizer = build_tokenizer(data_cfg, vocab_size)  # checks it fits model.vocab_size
        self.spec = tokenizer_spec(data_cfg, vocab_size)
        self.seq_length, self.vocab_size, self.seed, self.lanes = seq_length, vocab_size, seed, 0
        self.on_error = data_cfg.get("on_error", "fail")
        self.workers = int(data_cfg.get("workers", 1))
        self.eod_id = self.tokenizer.eod_id
        self.mine: list[Lane] = []
        self._cache: OrderedDict = OrderedDict()  # (source, epoch, unit position) -> the unit and its shuffled rows
        self._orders: dict = {}  # (source, epoch) -> the epoch's unit order
        self._split = [1] * len(self.sources)  # pieces per unit of each source (set by open)
        self.bytes_read = 0  # from storage, by this reader (units read again after leaving the cache count again)
        self._pool = None
        self._tokenizer = None  # data.workers=0: the stream's own tokenizer, loaded at its first document
        self.skipped, self.notices = 0, []
        self.history: dict | None = None  # a dict: every lane's documents taken, in order (tools/inspect_data.py)

    # -- layout
    def open(self, lanes: int, first_lane: int, count: int) -> "StreamSource":
        """Of ``lanes`` (the global batch size), read ``[first_lane, first_lane + count)`` (one data-parallel
        rank's slice of the batch)."""
        self.lanes = int(lanes)
        self._split = [max(1, -(-self.lanes // len(units))) for units in self.sources]
        self.mine = [Lane(i, self) for i in range(first_lane, first_lane + count)]
        return self

    def pieces(self, source: int) -> int:
        """Pieces of one epoch of ``source``: its units, each cut in as many as it takes to have a piece
        for every lane."""
        return len(self.sources[source]) * self._split[source]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    # -- state: one entry per lane; a reader knows only its own
    def state_dict(self) -> dict:
        return {"kind": self.kind, "version": STATE_VERSION, "lanes": self.lanes, "seed": self.seed,
                "sources": list(self.specs), "text_key": self.text_key, "files": [dict(f) for f in self.files],
                "read": [dict(d) for d in self.read_digests],
                "lane_states": {lane.index: lane.state_dict() for lane in self.mine}}

    def load_state_dict(self, state: dict) -> None:
        """Every lane's state (a checkpoint's); this reader takes its own lanes' (a lane the state does not
        hold was never read: under a batch ramp-up, a lane of a batch larger than any read yet)."""
        self.check_state(state)
        for mine, read in zip(self.read_digests, state["read"]):
            mine.update(read)
        lane_states = {int(k): v for k, v in state["lane_states"].items()}
        for i, lane in enumerate(self.mine):
            if lane.index in lane_states:
                lane.load_state_dict(lane_states[lane.index])
            else:
                self.mine[i] = Lane(lane.index, self)

    def check_state(self, state: dict, verify_content: bool = True) -> None:
        """A one-line DataError when ``state`` is not a state of this stream, or its files changed since.
        ``verify_content``: the rows read from a file whose modification time changed (same size) are read
        again and compared with their hashes (a file rewritten with the same rows passes)."""
        if state.get("kind") != self.kind:
            raise DataError(f"the checkpoint's data state is of kind {state.get('kind')!r}, not data.kind={self.kind} "
                            f"(data.kind changed since the checkpoint?)")
        if int(state.get("version", 1)) != STATE_VERSION:
            raise DataError(f"the checkpoint's stream state is of version {state.get('version', 1)}, this megand reads "
                            f"version {STATE_VERSION} (2: lanes read whole units; 3: the state identifies the files "
                            f"read): resume it with the megand that wrote it")
        if int(state["lanes"]) != self.lanes:
            raise DataError(f"the checkpoint's stream has {state['lanes']} lanes (its train.global_batch_size), this "
                            f"run {self.lanes}: a stream resumes only at the same global batch size")
        if list(state["sources"]) != self.specs:
            raise DataError(f"the checkpoint's stream reads data.paths {list(state['sources'])}, this run "
                            f"{self.specs}: a stream resumes only on the same sources")
        if int(state["seed"]) != self.seed:
            raise DataError(f"the checkpoint's stream was shuffled with train.seed={state['seed']}, this run's is "
                            f"{self.seed}: a stream resumes only with the same seed")
        if state["text_key"] != self.text_key:
            raise DataError(f"the checkpoint's stream read the texts of data.text_key={state['text_key']!r}, this run "
                            f"{self.text_key!r}: a stream resumes only on the same documents")
        for s, (spec, then, now) in enumerate(zip(self.specs, state["files"], self.files)):
            self._check_files(s, spec, then, now, state["read"][s], verify_content)

    def _check_files(self, s: int, spec: str, then: dict, now: dict, read: dict, verify_content: bool) -> None:
        why = "a stream resumes only on the files it read, unchanged"
        for path in now:
            if path not in then:
                raise DataError(f"data.paths entry {spec!r}: {path} was added since the checkpoint ({len(then)} "
                                f"file(s) then, {len(now)} now): {why}")
        for path, (size, mtime) in then.items():
            if path not in now:
                raise DataError(f"data.paths entry {spec!r}: {path} is gone since the checkpoint: {why}")
            if now[path][0] != size:
                raise DataError(f"{path}: changed since the checkpoint: {size} bytes then, {now[path][0]} now: {why}")
        for path, (size, mtime) in then.items():  # the same files and sizes: the same units
            if now[path][1] != mtime and verify_content:
                units = self.sources[s]
                for index, digest in read.items():
                    unit = units[int(index)]
                    if unit.path == path and rows_digest(self.read_unit(unit)) != digest:
                        where = (f" (rows from {unit.first_row})" if unit.row_group is not None
                                 else f" (lines from byte {unit.start})" if unit.start else "")
                        raise DataError(f"{path}: changed since the checkpoint: modified, and the rows read from "
                                        f"it{where} differ: {why}")

    # -- reading
    def piece_rows(self, source: int, epoch: int, position: int):
        """The unit of piece ``position`` of ``epoch`` of ``source`` and the piece's rows, in this epoch's
        shuffled order."""
        split = self._split[source]
        unit_position, piece = divmod(position, split)
        key = (source, epoch, unit_position)
        if key in self._cache:
            self._cache.move_to_end(key)
        else:
            units = self.sources[source]
            if (source, epoch) not in self._orders:
                if len(self._orders) > 2 * len(self.sources):  # lanes are at most an epoch apart, or so
                    self._orders.clear()
                self._orders[source, epoch] = np.random.default_rng([self.seed, source, epoch]).permutation(len(units))
            index = int(self._orders[source, epoch][unit_position])
            unit = units[index]
            rows = self.read_unit(unit)
            self.read_digests[source][str(index)] = rows_digest(rows)
            self.bytes_read += unit.size
            perm = np.random.default_rng([self.seed, source, epoch, unit_position]).permutation(len(rows))
            shuffled = [rows[int(i)] for i in perm]
            self._cache[key] = (unit, [shuffled[j::split] for j in range(split)])
            if len(self._cache) > len(self.mine) + UNIT_CACHE:
                self._cache.popitem(last=False)
        unit, pieces = self._cache[key]
        return unit, pieces[piece]

    def note_skipped(self, where: str, reason: str) -> None:
        self.skipped += 1
        if self.skipped == 1:
            self.notices.append(f" WARNING: data.on_error=skip: skipping malformed rows, the first: {where}: {reason}")

    def _tokenize(self, texts: list[str]) -> list[np.ndarray]:
        if self.workers <= 0:  # in this process: the stream's own tokenizer
            if self._tokenizer is None:
                self._tokenizer = _load_tokenizer(self.spec)
            return _encode(self._tokenizer, texts)
        if self._pool is None:  # an executor, not a Pool: a worker that dies (killed, out of memory) is an error
            self._pool = ProcessPoolExecutor(self.workers, mp_context=mp.get_context("spawn"),
                                             initializer=_init_worker, initargs=(self.spec,))
        per_task = max(1, -(-len(texts) // (4 * self.workers)))
        chunks = [texts[i:i + per_task] for i in range(0, len(texts), per_task)]
        try:
            return [ids for part in self._pool.map(functools.partial(_encode_in_worker, self.spec), chunks)
                    for ids in part]
        except BrokenProcessPool as e:
            raise DataError(f"a tokenizer worker process of the stream's reader died ({e}): killed, or out of "
                            f"memory? (data.workers={self.workers})") from e

    def _fill(self) -> None:
        """Take and tokenize documents until every lane of this reader holds its next sample (with worker
        processes: about its next ``TOKENIZE_AHEAD`` samples, so each round trip to the workers carries a
        useful amount of text)."""
        need = self.seq_length + 1
        ahead = need + (TOKENIZE_AHEAD - 1) * self.seq_length if self.workers > 0 else need
        while True:
            wanted, texts = [], []
            for lane in self.mine:
                have, planned = lane.buffered(), 0
                if have >= need:
                    continue
                while have + planned < ahead:  # about 3 characters a token: rarely a second round
                    doc, text = lane.take()
                    lane.docs.append(doc)
                    wanted.append(doc)
                    texts.append(text)
                    planned += len(text) // 3 + 1
            if not wanted:
                return
            for doc, tokens in zip(wanted, self._tokenize(texts)):
                if len(tokens) and int(tokens.max()) >= self.vocab_size:
                    raise DataError(f"{doc.where}: token id {int(tokens.max())} is outside model.vocab_size="
                                    f"{self.vocab_size} (a tokenizer that does not match the model?)")
                doc.tokens = tokens
            for lane in self.mine:  # documents without a token (empty text) are not documents
                lane.docs = deque(d for i, d in enumerate(lane.docs) if i == 0 or len(d.tokens))
                if lane.docs and not len(lane.docs[0].tokens):
                    lane.docs.popleft()
                    lane.offset = 0

    def next_samples(self) -> np.ndarray:
        """This reader's samples of the next global batch, in lane order: ``[lanes, seq_length + 1]``."""
        self._fill()
        return np.stack([lane.sample(self.seq_length) for lane in self.mine])


def build_stream(data_cfg, seq_length, vocab_size, seed, num_samples, source_class=StreamSource):
    """The train stream of ``data.paths`` and, when the run evaluates, the validation stream of
    ``data.valid_paths`` (no file in both), read by ``source_class``. Lanes are opened by the trainer,
    which knows the global batch size and this rank's slice."""
    train = source_class(data_cfg, seq_length, vocab_size, seed)
    if not num_samples[1]:
        return train, None, None
    valid_paths = data_cfg.get("valid_paths")
    if not valid_paths:
        raise DataError(f"data.kind={source_class.kind} evaluates (train.eval_iters>0) on a held-out stream: set "
                        f"data.valid_paths (files that data.paths does not hold), or train.eval_iters=0")
    valid = source_class({**dict(data_cfg), "paths": valid_paths}, seq_length, vocab_size, seed)
    held_out = {os.path.realpath(u.path) for units in valid.sources for u in units}
    both = sorted({u.path for units in train.sources for u in units if os.path.realpath(u.path) in held_out})
    if both:
        raise DataError(f"data.valid_paths holds {len(both)} file(s) that data.paths trains on, e.g. {both[0]}: the "
                        f"validation stream must be held out")
    return train, valid, None
