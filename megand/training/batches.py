"""From the dataset to this rank's micro-batches.

The global batch of iteration ``i`` is samples ``[i*B, (i+1)*B)`` whatever the layout; data-parallel
rank ``r`` takes the ``r``-th contiguous slice (of its share's size under ``parallel.dp_microbatches``:
megand/core/batch_shares.py) and splits it into micro-batches by stride (micro-batch ``j``
of ``m`` takes its rows ``j, j + m, ...``: see :func:`microbatch_rows`), so that micro-batch ``j`` of the step
holds the same samples at every dp with the same number of micro-batches. Tensor- and pipeline-parallel
peers of a data-parallel rank load the same samples identically (reading a few
memory-mapped samples costs less than broadcasting them over tp), except pipeline stages that hold neither
the embedding nor the loss: they read no tokens at all, only the positions, unless documents matter
(``DocumentFlags``): then every stage reads the samples to find the document boundaries, which travel
with the micro-batch (document ids for the attention mask, per-sample positions, the loss mask), and
drops the tokens. Under context parallelism each rank keeps its load-balanced sequence chunks and their
global positions; document ids stay whole-sequence (the attention looks up the keys' documents).
"""

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

from megand.core.batch_shares import replica_rows
from megand.core.transformer.documents import document_ids, document_positions
from megand.data.stream import merge_states
from megand.training.agreement import on_every_rank


@dataclass(frozen=True)
class DocumentFlags:
    """Megatron's three document options (``data.reset_attention_mask`` etc.) and the EOD id they use."""
    eod_id: int
    reset_attention_mask: bool = False  # attend only within the document
    reset_position_ids: bool = False  # positions restart at each document
    eod_mask_loss: bool = False  # no loss where the input token is EOD (the prediction across a boundary)

    @property
    def any(self) -> bool:
        return self.reset_attention_mask or self.reset_position_ids or self.eod_mask_loss


@dataclass
class MicroBatch:
    input_ids: torch.Tensor | None  # [b, s_local]; None on stages that need no tokens
    labels: torch.Tensor | None  # [b, s_local]
    positions: torch.Tensor  # [s_local] global token positions, or [b, s_local] with reset_position_ids
    batch_size: int
    document_ids: torch.Tensor | None = None  # [b, s] document of every token of the whole sequence
    loss_mask: torch.Tensor | None = None  # [b, s_local] 1.0 where the token's loss counts
    # document_ids kept on the host (where the data pipeline built them): context-parallel attention plans
    # its blocks from them without reading the device
    host_document_ids: torch.Tensor | None = None


def global_batch_range(iteration: int, global_batch_size: int) -> range:
    return range(iteration * global_batch_size, (iteration + 1) * global_batch_size)


def rank_microbatches(dataset, iteration, global_batch_size, micro_batch_size, topo, offset=0, seq_length=None,
                      needs_tokens=True, documents: DocumentFlags | None = None, device=None):
    """This rank's micro-batches of global batch ``iteration`` (samples from ``offset`` on), on ``device``
    (default: the rank's).

    ``needs_tokens=False`` (a middle pipeline stage): only positions (and document information when
    ``documents`` asks for it); ``seq_length`` is then required.
    """
    start, per_dp = replica_rows(topo.dp_microbatches, topo.dp_size, topo.dp_rank, global_batch_size)
    first = offset + iteration * global_batch_size + start
    use_documents = documents is not None and documents.any
    input_ids = labels = doc_ids = loss_mask = None
    if needs_tokens or use_documents:
        tokens = torch.from_numpy(np.stack([np.asarray(dataset[first + i], dtype=np.int64) for i in range(per_dp)]))
        seq_length = tokens.shape[1] - 1
        input_ids, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(seq_length)
    if use_documents:
        ids = document_ids(input_ids, documents.eod_id)
        if documents.reset_attention_mask:
            doc_ids = ids
        if documents.reset_position_ids:
            positions = document_positions(ids)
        if documents.eod_mask_loss:
            loss_mask = (input_ids != documents.eod_id).float()
        if not needs_tokens:
            input_ids = labels = None
    if topo.cp_size > 1:
        from megand.core.context_parallel import cp_positions, split_for_cp

        input_ids, labels, loss_mask = (None if t is None else split_for_cp(t, 1, topo.cp_rank, topo.cp_size)
                                        for t in (input_ids, labels, loss_mask))
        if positions.dim() == 2:
            positions = split_for_cp(positions, 1, topo.cp_rank, topo.cp_size)
        else:
            positions = cp_positions(seq_length, topo.cp_rank, topo.cp_size, positions.device)
    device = topo.device if device is None else device

    def part(t, rows):
        return None if t is None else t[rows.start::rows.step].contiguous().to(device)

    per_sample = positions.dim() == 2
    positions = positions.to(device)
    return [MicroBatch(part(input_ids, rows), part(labels, rows), part(positions, rows) if per_sample else positions,
                       micro_batch_size, part(doc_ids, rows), part(loss_mask, rows),
                       None if doc_ids is None else doc_ids[rows.start::rows.step].contiguous())
            for rows in microbatch_rows(per_dp, micro_batch_size)]


def microbatch_rows(rows: int, micro_batch_size: int) -> list[range]:
    """Which of a data-parallel rank's ``rows`` samples (its slice of the global batch) make each of its
    micro-batches: with ``m = rows / micro_batch_size`` micro-batches, micro-batch ``j`` takes rows ``j, j + m,
    j + 2m, ...``. Strided, not consecutive, so that micro-batch ``j`` of the step (every dp rank's ``j``-th)
    is samples ``j, j + m, j + 2m, ...`` of the global batch whatever dp is: the MoE balancing losses, computed
    over each micro-batch's tokens on every dp rank, are then the same at dp ranks of ``micro_batch_size``
    as on one process with micro-batches of ``dp x micro_batch_size`` (consecutive micro-batches of each
    contiguous dp slice would group samples no one-process run groups)."""
    m = rows // micro_batch_size
    return [range(j, rows, m) for j in range(m)]


def loss_token_count(microbatches, topo, default: int) -> torch.Tensor | int:
    """Tokens whose loss counts in the global batch: ``default`` (all of them) without a loss mask, else
    the mask's sum over this rank's micro-batches summed over data- and context-parallel ranks."""
    if not microbatches or microbatches[0].loss_mask is None:
        return default
    count = torch.stack([mb.loss_mask.sum() for mb in microbatches]).sum()
    if topo.dp_cp_size > 1:
        dist.all_reduce(count, group=topo.dp_cp_group)
    return count.clamp_min(1.0)  # a batch of EOD tokens only: loss 0, not nan


def mtp_token_counts(microbatches, topo, depths: int, samples: int, seq_length: int, device) -> torch.Tensor:
    """Tokens whose loss counts for each multi-token prediction depth k = 1..``depths`` in the global batch
    of ``samples``: those with a label k positions in (depth k has no target for the last k positions);
    without a loss mask ``samples x (seq_length - k)``, else the mask's sum past position k, summed over
    this rank's micro-batches and the data- and context-parallel ranks."""
    ks = range(1, depths + 1)
    if not microbatches or microbatches[0].loss_mask is None:
        # made on the device (no host-to-device copy)
        return samples * (seq_length - torch.arange(1, depths + 1, dtype=torch.float32, device=device))
    count = torch.stack([sum(mb.loss_mask[:, k:].sum() for mb in microbatches) for k in ks]).float()
    if topo.dp_cp_size > 1:
        dist.all_reduce(count, group=topo.dp_cp_group)
    return count.clamp_min(1.0)


def to_device(microbatches, device: torch.device) -> list:
    """``microbatches`` moved to ``device``; from pinned host memory without blocking on CUDA (the copy
    overlaps whatever the device is still running)."""
    if device.type == "cpu":
        return microbatches
    def move(t):
        return None if not isinstance(t, torch.Tensor) else t.pin_memory().to(device, non_blocking=True)
    on_host = ("batch_size", "host_document_ids")
    return [MicroBatch(**{f.name: move(getattr(mb, f.name)) if f.name not in on_host else getattr(mb, f.name)
                          for f in fields(MicroBatch)}) for mb in microbatches]


class Prefetcher:
    """Reads the next step's micro-batches on a background thread while this step computes.

    ``load(iteration, *rest)`` builds a step's micro-batches on the host (memory-mapped reads, stacking,
    the context-parallel split); :meth:`get` returns them on the device and starts reading the following
    step (``iteration + 1``, the same ``rest``: e.g. the sample offset and the dataset). A request for
    another step than the one read ahead (a resume, a rollback, a changed offset or dataset)
    waits for the read in flight, so the dataset is never read by two threads at once, and loads it
    directly. An error of a read ahead is raised by the :meth:`get` that asks for that step, never
    before: the last step's read ahead may well run past the data.
    """

    def __init__(self, load, device: torch.device, following=None):
        """``following(key)``: the key of the step after ``key`` (default: the next iteration, same ``rest``)."""
        self._load, self._device = load, device
        self._following = following or (lambda key: (key[0] + 1, *key[1:]))
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megand-data")
        self._ahead = None  # ((iteration, offset), future)

    def get(self, iteration: int, *rest, read_ahead: bool = True) -> list:
        """The step's micro-batches; then, with ``read_ahead``, starts reading the following step."""
        key = (iteration, *rest)
        if self._ahead is not None and len(self._ahead[0]) == len(key) and all(
                a is b or a == b for a, b in zip(self._ahead[0], key)):
            host = self._ahead[1].result()
        else:
            self._drain()
            host = self._load(*key)
        if read_ahead:
            following = self._following(key)
            self._ahead = (following, self._pool.submit(self._load, *following))
        else:
            self._ahead = None
        return to_device(host, self._device)

    def _drain(self):
        if self._ahead is not None:
            self._ahead[1].exception()  # wait; a failed read ahead of a step nobody asked for is dropped
            self._ahead = None

    def close(self):
        self._drain()
        self._pool.shutdown(wait=True)


def samples_microbatches(tokens: torch.Tensor | None, micro_batch_size, topo, seq_length, needs_tokens=True,
                         documents: DocumentFlags | None = None, device=None):
    """This rank's micro-batches from its samples ``tokens`` (``[per_dp, seq_length + 1]``, read already)."""
    class Rows:  # the samples as the dataset rank_microbatches reads
        def __getitem__(self, i):
            return tokens[i].numpy()

    per_dp = tokens.shape[0]
    view = SimpleNamespace(dp_size=1, dp_rank=0, dp_microbatches=None, cp_size=topo.cp_size, cp_rank=topo.cp_rank, device=topo.device)
    return rank_microbatches(Rows(), 0, per_dp, micro_batch_size, view, seq_length=seq_length,
                             needs_tokens=needs_tokens, documents=documents, device=device)


def data_peer_group(topo):
    """Collective: a gloo group of the ranks that share this rank's data-parallel rank (its tp/cp/pp peers),
    and the global rank that reads for them (the first)."""
    by_dp: dict[int, list[int]] = {}
    for r in range(topo.world_size):
        by_dp.setdefault(topo.layout.coords(r)["dp"], []).append(r)
    mine = None
    for dp_rank in sorted(by_dp):
        group = dist.new_group(by_dp[dp_rank], backend="gloo")  # every rank takes part in every group
        if dp_rank == topo.dp_rank:
            mine = group
    return mine, by_dp[topo.dp_rank][0]


class StreamBatches:
    """The feed of a stream (a :class:`megand.data.stream.StreamSource`): its only consumer, which reads
    each step's samples once, in order, on a background thread.

    Per data-parallel rank, one rank (the first of its tp/cp/pp peers) reads the lanes of its slice of the
    global batch and broadcasts the samples to its peers, so nothing is tokenized twice. :meth:`get`
    returns the next step's micro-batches and starts reading the following step. The stream's state is
    the state after the last batch :meth:`get` returned (a read ahead is not consumed): what a checkpoint
    saves. :meth:`load_state_dict` waits for a read in flight, drops it (the state it is reset to comes
    before it: nothing is lost), and the next :meth:`get` reads from the loaded state. A read error
    (a malformed row, an unreadable file) is agreed on by every rank and raised by the :meth:`get` of the
    step that needs it, on every rank alike.

    Under a batch ramp-up (``ramp``), slot ``s`` of a step's global batch of ``b`` samples is lane ``s`` of
    the final batch's lanes: lanes ``[b, final)`` wait unread until the batch grows to them. When ``b``
    changes, the lanes move to the readers of their new slices with their states (gathered from the
    readers), so the ramp-up reads exactly the stream of the same ramp-up at any layout.
    """

    def __init__(self, source, topo, global_batch_size: int, micro_batch_size: int, seq_length: int,
                 needs_tokens=True, documents=None, device=None, ramp=None):
        from megand.training.rampup import ConstantBatch

        self.topo, self.micro_batch_size, self.seq_length = topo, micro_batch_size, seq_length
        self.needs_tokens, self.documents = needs_tokens, documents
        self.device = topo.device if device is None else device
        self.lanes = global_batch_size  # the final global batch's slots
        self.ramp = ramp or ConstantBatch(global_batch_size)
        self.group, self.reader_rank = data_peer_group(topo)
        self.all_ranks = dist.new_group(backend="gloo")  # the reading thread's: read errors, lanes changing reader
        self.state_ranks = dist.new_group(backend="gloo")  # gathering the state (the training thread's)
        self.is_reader = topo.rank == self.reader_rank
        self.source = source  # every rank checks a loaded state against its files; only the reader reads
        self.opened = None  # the global batch size this reader's lanes are opened for
        self.pending = None  # a loaded state (every lane's), taken by the next read
        self.state = None  # this reader's lanes' state after the last batch returned
        self._open(self.ramp.batch_size(0))  # no collective: nothing to gather yet
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megand-stream")
        self._ahead = self._ahead_at = None

    def _open(self, batch_size: int) -> None:
        """Collective over every rank (the reading thread's): this reader's lanes for global batches of
        ``batch_size``, in the state of the lanes where they stand now, whichever reader read them."""
        state = self.pending
        if state is None and self.opened is not None:  # a ramp-up step: gather the lanes from their readers
            every = [None] * self.topo.world_size
            dist.all_gather_object(every, self.source.state_dict() if self.is_reader else None, group=self.all_ranks)
            state = merge_states([s for s in every if s is not None])
        if self.is_reader:
            self.source.open(self.lanes, *self.topo.replica_rows(batch_size))
            if state is not None:
                self.source.load_state_dict(state)
            self.state = self.source.state_dict()
        self.opened, self.pending = batch_size, None

    def _read(self, consumed: int):
        """Collective over every rank: ``(samples, state after them)`` of the step after ``consumed``
        samples, read and broadcast once."""
        payload = [None]
        try:
            batch_size = self.ramp.batch_size(consumed)
            if batch_size != self.opened:
                self._open(batch_size)
            if self.is_reader:
                samples = self.source.next_samples()
                notices, self.source.notices = self.source.notices, []
                payload = [(samples, self.source.state_dict(), notices, None)]
        except Exception as e:  # noqa: BLE001 - agreed on below, raised by the step that needs it
            payload = [(None, None, [], e)]
        if dist.get_world_size(self.group) > 1:
            dist.broadcast_object_list(payload, src=self.reader_rank, group=self.group)
        samples, state, notices, error = payload[0]
        errors = [error]
        if self.topo.world_size > 1:
            failed = torch.tensor([int(error is not None)])
            dist.all_reduce(failed, group=self.all_ranks)
            if failed.item():
                errors = [None] * self.topo.world_size
                dist.all_gather_object(errors, error, group=self.all_ranks)
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            error.every_rank = True
            raise error
        return torch.from_numpy(samples), state, notices

    def get(self, consumed: int = 0, read_ahead: bool = True) -> list:
        """The micro-batches of the step after ``consumed`` samples (this rank's); then, with
        ``read_ahead``, starts reading the next step's."""
        if self._ahead is None:
            self._ahead, self._ahead_at = self._pool.submit(self._read, consumed), consumed
        if self._ahead_at != consumed:
            raise RuntimeError(f"the stream read ahead the step after {self._ahead_at} samples, the trainer asks "
                               f"for the step after {consumed}")
        samples, state, notices = self._ahead.result()
        self._ahead = None
        if read_ahead:
            after = consumed + self.ramp.batch_size(consumed)
            self._ahead, self._ahead_at = self._pool.submit(self._read, after), after
        if self.is_reader:  # each reader its own (data-parallel rank r's lanes)
            self.state = state
            for line in notices:
                print(f"{line} (reader of data-parallel rank {self.topo.dp_rank})", flush=True)
        host = samples_microbatches(samples, self.micro_batch_size, self.topo, self.seq_length, self.needs_tokens,
                                    self.documents, device=torch.device("cpu"))
        return to_device(host, self.device)

    def restart(self) -> None:
        """Back to the stream's start (a validation stream, read from its start at every evaluation); the
        units read stay in the reader's cache."""
        self._drain()
        self.opened = self.pending = None
        self._open(self.ramp.batch_size(0))  # no collective: nothing to gather

    def state_dict(self) -> dict:
        """Collective: every lane's state (each reader knows its own lanes; a lane never read has none)."""
        if self.pending is not None:  # loaded, nothing read since
            return self.pending
        every = [None] * self.topo.world_size
        dist.all_gather_object(every, self.state, group=self.state_ranks)
        return merge_states([s for s in every if s is not None])

    def load_state_dict(self, state: dict | None) -> str | None:
        """Collective: every lane's state (a checkpoint's), checked here against the stream (its files on
        every rank, the rows read from a modified one on the readers; a mismatch is one DataError on every
        rank), taken by the next read. A checkpoint without a state of this stream (``None``, or another
        kind's): the stream starts from its beginning, and the notice says so."""
        if state is None or state.get("kind") != self.source.kind:
            return "holds no stream state: the stream starts from its beginning"
        self._drain()
        on_every_rank(lambda: self.source.check_state(state, verify_content=self.is_reader))
        self.opened, self.pending, self.state = None, state, None
        return None

    def reserve(self, samples: int) -> None:
        """A stream has no end to extend: nothing to do."""

    def _drain(self):
        if self._ahead is not None:
            self._ahead.exception()  # wait: the state the caller loads comes before this read
            self._ahead = None

    def close(self):
        self._drain()
        self._pool.shutdown(wait=True)
        if self.source is not None:
            self.source.close()
