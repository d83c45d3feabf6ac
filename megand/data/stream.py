"""Streaming raw corpora: JSON lines (``.jsonl``, ``.jsonl.gz``) and Parquet files with a ``text`` field,
tokenized on the fly and packed into samples, with a state that a checkpoint keeps (``data.kind=stream``).

The global stream does not depend on the parallel layout. A global batch of ``B`` samples has ``B``
*lanes*: lane ``l`` fills slot ``l`` of every global batch with its own packed stream of documents, and
data-parallel rank ``r`` of ``dp`` owns the lanes of its slice of the batch, ``[r*B/dp, (r+1)*B/dp)``.
So iteration ``i`` trains on the same tokens at every ``dp`` (and tp/cp/pp), and a checkpoint holds every
lane's position: resumed at another ``dp``, each rank takes the positions of its lanes, and no document
is repeated or skipped.

Where lane ``l`` reads from: every source of ``data.paths`` is a list of *units*, a ``.jsonl`` or
``.jsonl.gz`` file or one row group of a Parquet file. Each epoch of a source visits its units in an
order shuffled by ``(seed, source, epoch)``, and the documents of one unit in an order shuffled by
``(seed, source, epoch, unit)`` (the unit is the shuffle buffer). Document ``k`` (in that order) of the
``p``-th unit of the epoch belongs to lane ``(p + k) mod B``: every document of an epoch belongs to
exactly one lane. With several sources, a lane takes its next document from the source furthest behind
its weight in characters of text read (weights are shares of text, about shares of tokens).

A lane's samples are its documents' tokens, each document followed by the EOD id, cut into
``seq_length + 1`` token windows that overlap by one token (the last label of one sample is the first
input of the next, as for indexed data). Its state is where the document it is inside starts (the
cursors and characters read of every source before it) and the token offset there.

Each reader reads every unit that holds one of its lanes' documents (reading a unit costs far less than
tokenizing it) and tokenizes only its lanes' documents, in ``data.workers`` worker processes.
"""

from __future__ import annotations

import gzip
import multiprocessing as mp
import os
from collections import OrderedDict, deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

import numpy as np

from megand.data.errors import DataError
from megand.data.source import DataSource, register_kind

TOKENIZE_AHEAD = 4  # samples per lane tokenized in one round trip to the worker processes
UNIT_CACHE = 16  # units (decoded rows) a reader keeps: its lanes move through the units together
TEXT_KEY = "text"


@dataclass(frozen=True)
class Unit:
    path: str
    row_group: int | None  # None: the whole file (JSON lines)
    first_row: int = 1  # the file's row number of the unit's first row


def list_units(spec: str) -> list[Unit]:
    """The units of one ``data.paths`` entry (a directory, a glob or a file), checked readable."""
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
            if TEXT_KEY not in names:
                raise DataError(f"{path}: no column {TEXT_KEY!r} (columns: {', '.join(names)})")
            row = 1
            for g in range(meta.num_row_groups):
                units.append(Unit(path, g, row))
                row += meta.row_group(g).num_rows
        else:
            units.append(Unit(path, None))
    return units


def read_unit(unit: Unit) -> list[tuple[int, object]]:
    """``(row number, raw row)`` of every non-blank row: bytes of a JSON line, or a Parquet value."""
    try:
        if unit.row_group is None:
            opener = gzip.open if unit.path.endswith(".gz") else open
            with opener(unit.path, "rb") as f:
                return [(n, line) for n, line in enumerate(f, 1) if line.strip()]
        import pyarrow.parquet as pq

        values = pq.ParquetFile(unit.path).read_row_group(unit.row_group, columns=[TEXT_KEY]).column(0).to_pylist()
        return list(enumerate(values, unit.first_row))
    except (OSError, EOFError, ValueError) as e:  # also gzip's BadGzipFile, pyarrow's ArrowInvalid
        where = unit.path if unit.row_group is None else f"{unit.path} (row group {unit.row_group})"
        raise DataError(f"{where}: cannot read ({type(e).__name__}: {' '.join(str(e).split())})") from e


def parse_row(unit: Unit, raw) -> tuple[str | None, str | None]:
    """``(text, None)`` or ``(None, reason)``."""
    if unit.row_group is None:
        from megand.data.jsonl import parse_json_line

        texts, reason = parse_json_line(raw, [TEXT_KEY])
        return (None, reason) if reason else (texts[0], None)
    if not isinstance(raw, str):
        return None, f"column {TEXT_KEY!r} is {'null' if raw is None else type(raw).__name__ + ', not a string'}"
    return raw, None


# ---- tokenizing: in worker processes, or in the reader when data.workers=0 ---------------------------------
_worker_tokenizer = None


def tokenizer_spec(data_cfg, vocab_size: int) -> tuple:
    """What a worker needs to load the run's tokenizer (a null tokenizer without ``data.tokenizer``)."""
    return (data_cfg.get("tokenizer"), data_cfg.get("tokenizer_type"), data_cfg.get("eod_id"), vocab_size)


def _load_tokenizer(spec):
    from megand.data.tokenizer import NullTokenizer, load_tokenizer

    path, kind, eod_id, vocab_size = spec
    if not path:
        return NullTokenizer(vocab_size)
    return load_tokenizer(path, kind, eod_id, num_threads=1)


def _init_worker(spec) -> None:
    global _worker_tokenizer
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _worker_tokenizer = _load_tokenizer(spec)


def _encode(texts: list[str]) -> list[np.ndarray]:
    """Each text's ids followed by the EOD id (an empty document: empty, and dropped by the lane)."""
    tok = _worker_tokenizer
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
        self.cursors = [[0, 0, self.first_own(0)] for _ in range(n)]  # [epoch, unit position, row] per source
        self.chars = [0] * n  # characters of text taken from each source
        self.docs: deque[Document] = deque()  # taken, in order; docs[0] holds the next sample's first token
        self.offset = 0  # that token's index in docs[0]

    def first_own(self, position: int) -> int:
        """The first row of the ``position``-th unit of an epoch that belongs to this lane."""
        return (self.index - position) % self.stream.lanes

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
        units = self.stream.sources[s]
        cursor = self.cursors[s]
        passed = 0  # units passed without a document for this lane
        while True:
            epoch, position, row = cursor
            if position >= len(units):
                cursor[:] = [epoch + 1, 0, self.first_own(0)]
                continue
            unit, rows = self.stream.unit_rows(s, epoch, position)
            if row >= len(rows):
                passed += 1
                if passed > 2 * len(units):
                    skipped = f", {self.stream.skipped} malformed row(s) skipped" if self.stream.skipped else ""
                    raise DataError(f"data.paths entry {self.stream.specs[s]!r}: stream lane {self.index} found no "
                                    f"document in two epochs of its {len(units)} unit(s) (files and Parquet row "
                                    f"groups{skipped}): the stream is empty, or has not clearly more documents "
                                    f"than the {self.stream.lanes} lanes (train.global_batch_size)")
                cursor[:] = [epoch, position + 1, self.first_own(position + 1)]
                continue
            cursor[2] = row + self.stream.lanes
            rowno, raw = rows[row]
            text, reason = parse_row(unit, raw)
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


class StreamSource(DataSource):
    """The stream of ``data.paths``; a reader :meth:`open` s the lanes of one data-parallel rank."""

    is_stream = True

    def __init__(self, data_cfg, seq_length: int, vocab_size: int, seed: int):
        from megand.data.builder import parse_paths
        from megand.data.tokenizer import build_tokenizer

        paths = parse_paths(data_cfg.get("paths"))
        self.specs = [spec for w, spec in paths if w > 0]
        total = sum(w for w, _ in paths)
        self.weights = [w / total for w, _ in paths if w > 0]
        self.sources = [list_units(spec) for spec in self.specs]
        self.tokenizer = build_tokenizer(data_cfg, vocab_size)  # checks it fits model.vocab_size
        self.spec = tokenizer_spec(data_cfg, vocab_size)
        self.seq_length, self.vocab_size, self.seed, self.lanes = seq_length, vocab_size, seed, 0
        self.on_error = data_cfg.get("on_error", "fail")
        self.workers = int(data_cfg.get("workers", 1))
        self.eod_id = self.tokenizer.eod_id
        self.mine: list[Lane] = []
        self._cache: OrderedDict = OrderedDict()
        self._pool = None
        self.skipped, self.notices = 0, []
        self.history: dict | None = None  # a dict: every lane's documents taken, in order (tools/inspect_data.py)

    # -- layout
    def open(self, lanes: int, first_lane: int, count: int) -> "StreamSource":
        """Of ``lanes`` (the global batch size), read ``[first_lane, first_lane + count)`` (one data-parallel
        rank's slice of the batch)."""
        self.lanes = int(lanes)
        self.mine = [Lane(i, self) for i in range(first_lane, first_lane + count)]
        return self

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    # -- state: one entry per lane; a reader knows only its own
    def state_dict(self) -> dict:
        return {"kind": "stream", "lanes": self.lanes, "seed": self.seed, "sources": list(self.specs),
                "lane_states": {lane.index: lane.state_dict() for lane in self.mine}}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "stream":
            raise DataError(f"the checkpoint's data state is of kind {state.get('kind')!r}, not a stream "
                            f"(data.kind changed since the checkpoint?)")
        if int(state["lanes"]) != self.lanes:
            raise DataError(f"the checkpoint's stream has {state['lanes']} lanes (its train.global_batch_size), this "
                            f"run {self.lanes}: a stream resumes only at the same global batch size")
        if list(state["sources"]) != self.specs:
            raise DataError(f"the checkpoint's stream reads data.paths {list(state['sources'])}, this run "
                            f"{self.specs}: a stream resumes only on the same sources")
        lane_states = {int(k): v for k, v in state["lane_states"].items()}
        for lane in self.mine:
            lane.load_state_dict(lane_states[lane.index])

    # -- reading
    def unit_rows(self, source: int, epoch: int, position: int):
        """The ``position``-th unit of ``epoch`` of ``source`` and its rows in this epoch's shuffled order."""
        key = (source, epoch, position)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        units = self.sources[source]
        order = np.random.default_rng([self.seed, source, epoch]).permutation(len(units))
        unit = units[int(order[position])]
        rows = read_unit(unit)
        perm = np.random.default_rng([self.seed, source, epoch, position]).permutation(len(rows))
        value = (unit, [rows[int(i)] for i in perm])
        self._cache[key] = value
        if len(self._cache) > UNIT_CACHE:
            self._cache.popitem(last=False)
        return value

    def note_skipped(self, where: str, reason: str) -> None:
        self.skipped += 1
        if self.skipped == 1:
            self.notices.append(f" WARNING: data.on_error=skip: skipping malformed rows, the first: {where}: {reason}")

    def _tokenize(self, texts: list[str]) -> list[np.ndarray]:
        if self.workers <= 0:
            global _worker_tokenizer
            if _worker_tokenizer is None:
                _worker_tokenizer = _load_tokenizer(self.spec)
            return _encode(texts)
        if self._pool is None:  # an executor, not a Pool: a worker that dies (killed, out of memory) is an error
            self._pool = ProcessPoolExecutor(self.workers, mp_context=mp.get_context("spawn"),
                                             initializer=_init_worker, initargs=(self.spec,))
        per_task = max(1, -(-len(texts) // (4 * self.workers)))
        chunks = [texts[i:i + per_task] for i in range(0, len(texts), per_task)]
        try:
            return [ids for part in self._pool.map(_encode, chunks) for ids in part]
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


@register_kind("stream")
def build_stream(data_cfg, seq_length, vocab_size, seed, num_samples):
    """The train stream (validation and test splits are not streamed: ``train.eval_iters`` must be 0).
    Lanes are opened by the trainer, which knows the global batch size and this rank's slice."""
    if num_samples[1] or num_samples[2]:
        raise DataError("data.kind=stream has no validation split: set train.eval_iters=0")
    return StreamSource(data_cfg, seq_length, vocab_size, seed), None, None
