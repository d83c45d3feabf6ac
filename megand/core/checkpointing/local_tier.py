"""The node-local checkpoint tier: frequent, cheap saves to each node's own disk, every rank's state
replicated on a peer node, restored without the shared file system while every rank's state survives
somewhere (its own node, or the peer that holds its replica).

    ${local_dir}/iter_0000012/rank_00003.pt      rank 3's own state, written by rank 3
    ${local_dir}/iter_0000012/replica_00001.pt   rank 1's state, received from rank 1 (a rank of another node)

Each rank saves *its own* state as it holds it (its local parameters, or under ZeRO-3 its slices of them;
its optimizer shard; the persistent buffers; its random streams; rank 0 also the run's scalars and the
trainer's extra state), and sends the same bytes to its peer: the rank of the same local index on the next
node (torchrun's ``GROUP_RANK``). What the ranks of a data-parallel group hold alike (the replicated
parameters, and their optimizer state unless it is distributed) is saved once per group: each rank saves a
``1/dp`` piece of it, and a restore gathers the pieces over the group; so a node writes and reads its
shards, not dp copies of the model. A file is a JSON header, then the tensors' raw bytes (aligned), then
this rank's piece, then the random streams and scalars (``torch.save``, small): a restore reads the payload
straight into one buffer, checks its CRC there and copies each tensor once into the live one. Restoring
is exact, and only possible at the same layout (the same ranks holding the same shards). The layout and a
signature of every tensor's name, dtype, shape and whether it is saved once per group are recorded in each
file's header; a run at another layout, sharding level or precision ignores the tier and loads the shared
one.

A file is written to ``*.tmp`` and renamed once complete (and flushed), so a crash never leaves a file
that looks complete; older iterations are removed only after every rank has written (and replicated)
the new one: the last complete local state is never destroyed by a save that fails or dies half-way.

Restore is collective and reads nothing of the shared tier but its ``latest`` pointer (see
:meth:`LocalTier.choose`). Before the model exists, every rank lists what its node's directory holds (the
headers only), the lists are gathered, and the newest iteration for which every rank's state is held
somewhere (as its own file or a replica) wins over the shared tier when it is at least as new as the shared
``latest``; rank 0's header gives what the run needs before it builds its model. Once the model exists the
layout and every tensor's signature are checked, then each rank's state is read where it is (by the rank
itself when its node kept it) and sent to it over the tier's own process group. A copy that fails its
checksum (or cannot be read) is passed over for the replica of the same state, and when neither is
intact the run loads the shared tier, each with a line saying so.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import struct
import time
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megand.core.checkpointing import files
from megand.core.checkpointing.errors import CheckpointWriteError, describe_write_error
from megand.core.checkpointing.pieces import Piece
from megand.core.checkpointing.staging import HostStaging
from megand.core.distributed.data_parallel import is_expert

MAGIC = b"megand-local-2\n"
OWN, REPLICA = "rank", "replica"


def node_rank() -> int:
    """This process's node: the agent's group rank torchrun gives it (0 when launched otherwise)."""
    return int(os.environ.get("GROUP_RANK", 0))


def file_name(kind: str, rank: int) -> str:
    return f"{kind}_{rank:05d}.pt"


@dataclass
class RankState:
    """This rank's state as it holds it (:func:`rank_tensors`): ``tensors`` by names unique to it, and those of
    them (``replicated``) that every rank of ``group`` (ranks, this one among them) holds bit for bit alike."""

    tensors: dict[str, torch.Tensor]
    replicated: frozenset = frozenset()
    group: tuple[int, ...] = ()


def rank_tensors(named_params, optimizer, named_buffers) -> RankState:
    """This rank's state as it holds it, by names unique to it: every local parameter whole (under ZeRO-3
    its packed slices, the only values it holds between steps), its optimizer shard, the buffers.

    Replicated over the dense data-parallel group (dp x cp), which applies the same reduced gradients to the
    same values on every rank: the dense trained parameters unless ZeRO-3 slices them, and their optimizer
    state unless the optimizer is distributed. Those are saved once per group (each rank a ``1/group`` piece
    of them): a save and a restore cost the shard, not dp copies of it. Everything else (slices, experts,
    whose group is another, buffers) is saved by each rank."""
    ddp, out, replicated = optimizer.ddp, {}, set()
    dense = getattr(ddp.topo, "dp_cp_size", 1) > 1

    def alike(p) -> bool:
        return dense and p.requires_grad and not (ddp.expert_parallel and is_expert(p))

    if ddp.shard_params:
        name_of = {p: n for n, p in named_params}
        for p, lo, hi, data in ddp.param_shards():
            out[f"param.{name_of[p]}[{lo}:{hi}]"] = data
    else:
        for name, p in named_params:
            out[f"param.{name}"] = p.detach()
            if alike(p):
                replicated.add(f"param.{name}")
    for shard in optimizer.sharded_state_dict():
        for kind, t in shard.tensors.items():
            key = f"optim.{shard.name}.{kind}[{shard.lo}:{shard.hi}]"
            out[key] = t
            if not ddp.distributed and alike(shard.param):
                replicated.add(key)
    for name, b in named_buffers:
        out[f"buffer.{name}"] = b.detach()
    group = tuple(dist.get_process_group_ranks(ddp.topo.dp_cp_group)) if replicated else ()
    return RankState(out, frozenset(replicated), group)


def signature(state: RankState, layout: dict) -> str:
    """What must be equal for a saved state to load into these tensors: the layout, every name, dtype, shape,
    and which are saved once per data-parallel group (of which size)."""
    text = json.dumps([layout, len(state.group), sorted((k, str(t.dtype), list(t.shape), k in state.replicated)
                                                         for k, t in state.tensors.items())])
    return hashlib.sha1(text.encode()).hexdigest()


ALIGN = 8  # every tensor's bytes start at a multiple of the largest element size


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _offsets(tensors: dict[str, torch.Tensor], keys) -> tuple[dict[str, int], int]:
    """Where each of ``keys`` (in this order) starts in their concatenation, and its length (aligned)."""
    offsets, at = {}, 0
    for k in keys:
        offsets[k] = at
        at += _aligned(_nbytes(tensors[k]))
    return offsets, at


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


@dataclass
class _Layout:
    """Where a rank's state lies in its file's payload: the tensors it alone saves (``unique``, at
    ``offsets``, ``unique_bytes`` in all), then its piece ``[lo, hi)`` of the concatenation of the
    ``replicated`` tensors (``replicated_bytes``, split into ``size`` pieces of ``piece`` bytes, this rank's
    the ``index``-th), then the pickled random streams and scalars."""

    unique: list[str]
    replicated: list[str]
    offsets: dict[str, int]
    unique_bytes: int
    replicated_bytes: int
    size: int
    index: int
    piece: int

    @classmethod
    def of(cls, state: RankState, rank: int) -> _Layout:
        names = sorted(state.tensors)
        unique = [k for k in names if k not in state.replicated]
        replicated = [k for k in names if k in state.replicated]
        offsets, unique_bytes = _offsets(state.tensors, unique)
        rep_offsets, replicated_bytes = _offsets(state.tensors, replicated)
        size = max(len(state.group), 1)
        index = state.group.index(rank) if state.group else 0
        return cls(unique, replicated, {**offsets, **rep_offsets}, unique_bytes, replicated_bytes, size, index,
                   _aligned(-(-replicated_bytes // size)))

    @property
    def lo(self) -> int:
        return min(self.index * self.piece, self.replicated_bytes)

    @property
    def hi(self) -> int:
        return min((self.index + 1) * self.piece, self.replicated_bytes)


def write_atomic(path: str, chunks) -> None:
    """``chunks`` (bytes-like) to ``path`` through ``path.tmp``, flushed, then renamed."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def encode_header(header: dict) -> bytes:
    text = json.dumps(header).encode()
    return MAGIC + struct.pack("<Q", len(text)) + text


def read_header(path: str) -> dict | None:
    """The header of a local-tier file, or None when it is not one (or is unreadable)."""
    try:
        with open(path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                return None
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            header["payload_at"] = len(MAGIC) + 8 + n
            header["file_bytes"] = os.path.getsize(path)
        return header
    except (OSError, ValueError, struct.error):
        return None


@dataclass
class Choice:
    """The local iteration a restart restores, chosen before the model exists (the run may take its model
    from it): for each rank the copies of its state that survive, its own file first, then its replica;
    the run's metadata (model section, config) recorded with rank 0's state."""

    iteration: int
    copies: dict[int, list[tuple[int, str, dict]]]  # rank -> [(the rank that reads it, path, header)]
    meta: dict
    shared_bytes: int  # read from the shared tier to choose: its ``latest`` pointer
    seconds: float  # spent choosing (part of the restore's time)


@dataclass
class LocalRestore:
    """What a restore from the local tier read: this rank's state (tensors, random streams, and on every rank
    rank 0's scalars), the bytes read from the local disks (all ranks together)."""

    iteration: int
    state: dict
    common: dict
    bytes_read: int
    from_replica: list[int] = field(default_factory=list)  # ranks whose own file was lost or damaged


class LocalTier:
    def __init__(self, local_dir: str, run: str, timeout):
        """``run``: what identifies the run the tier belongs to (its shared save directory). Collective (a
        process group of its own, and the ranks' nodes). The state itself is the caller's: the tier stores,
        replicates, finds and reads bytes, and knows no model."""
        self.dir, self.run = local_dir, run
        self.group, self.timeout, self._groups = dist.new_group(backend="gloo", timeout=timeout), timeout, {}
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        nodes = [None] * self.world
        dist.all_gather_object(nodes, node_rank(), group=self.group)
        members = {n: [r for r in range(self.world) if nodes[r] == n] for n in sorted(set(nodes))}
        order = sorted(members)
        self.nodes = len(order)
        self.node_of, self.first_on_node = nodes, members[nodes[self.rank]][0] == self.rank

        def peer(r: int) -> int:  # the same local index on the next node
            mine = members[nodes[r]]
            nxt = members[order[(order.index(nodes[r]) + 1) % len(order)]]
            return nxt[mine.index(r) % len(nxt)]

        self.peer = peer(self.rank) if self.nodes > 1 else None
        self.sources = [r for r in range(self.world) if self.nodes > 1 and peer(r) == self.rank]
        self.staging = HostStaging()

    @property
    def replicated(self) -> bool:
        return self.nodes > 1

    def _iter_dir(self, iteration: int) -> str:
        return os.path.join(self.dir, files.iter_dir_name(iteration))

    # ----------------------------------------------------------------------------------------- save
    def save(self, iteration: int, state: RankState, rng_state: dict, common: dict | None,
             layout: dict, meta: dict | None) -> None:
        """Collective: write this rank's state (``state``: :func:`rank_tensors`; of its replicated tensors only
        this rank's piece) and its peer's replica of it; remove the older iterations once every rank has.
        ``meta`` (rank 0): what a restart needs to know before it builds its model (the model section, the
        run's config), kept in the file's header. CheckpointWriteError on every rank alike when a write failed
        anywhere (the files of this iteration are removed, the previous local state is kept)."""
        staged = self.staging.stage([Piece(k, (), (), t) for k, t in state.tensors.items()], copy=False)
        host = {p.key: p.tensor for p in staged}
        where = _Layout.of(state, self.rank)
        small = io.BytesIO()
        torch.save({"rng": rng_state, "common": common}, small)
        small = small.getbuffer()
        piece = where.hi - where.lo
        payload = torch.zeros(where.unique_bytes + piece + len(small), dtype=torch.uint8)
        for k in where.unique:
            at = where.offsets[k]
            payload[at:at + _nbytes(host[k])] = _as_bytes(host[k])
        for k in where.replicated:  # the part of each replicated tensor inside this rank's piece
            at, n = where.offsets[k], _nbytes(host[k])
            lo, hi = max(at, where.lo), min(at + n, where.hi)
            if lo < hi:
                payload[where.unique_bytes + lo - where.lo:where.unique_bytes + hi - where.lo] = \
                    _as_bytes(host[k])[lo - at:hi - at]
        payload[where.unique_bytes + piece:] = torch.frombuffer(small, dtype=torch.uint8)
        payload = payload.numpy()
        header = {"iteration": iteration, "rank": self.rank, "run": self.run, "layout": layout,
                  "signature": signature(state, layout), "bytes": len(payload), "crc32": zlib.crc32(payload),
                  "small_bytes": len(small),
                  "piece_crc32": zlib.crc32(payload[where.unique_bytes:where.unique_bytes + piece])}
        if meta is not None:
            header["meta"] = meta
        head = encode_header(header)
        iter_dir = self._iter_dir(iteration)
        written, problem = [], None
        try:
            os.makedirs(iter_dir, exist_ok=True)
            path = os.path.join(iter_dir, file_name(OWN, self.rank))
            written.append(path)
            write_atomic(path, (head, payload))
        except OSError as e:
            problem = f"rank {self.rank}: {describe_write_error(e, self.dir)}"
        received = self._exchange(bytearray(head) + payload.tobytes() if self.replicated else None)
        for source, data in received.items():
            if problem is None:
                try:
                    path = os.path.join(iter_dir, file_name(REPLICA, source))
                    written.append(path)
                    write_atomic(path, (data,))
                except OSError as e:
                    problem = f"rank {self.rank}: {describe_write_error(e, self.dir)}"
        problems = [None] * self.world
        dist.all_gather_object(problems, problem, group=self.group)
        problems = [p for p in problems if p]
        if problems:
            for path in written:
                for p in (path, f"{path}.tmp"):
                    if os.path.exists(p):
                        os.remove(p)
            more = f" (and {len(problems) - 1} other rank(s))" if len(problems) > 1 else ""
            raise CheckpointWriteError(f"local save of iteration {iteration} to {self.dir} failed: {problems[0]}{more}; "
                                       f"the previous local state is kept")
        if self.first_on_node:  # one rank per node, once every rank has written this iteration
            self.remove(lambda it: it < iteration)

    def _exchange(self, blob: bytearray | None) -> dict:
        """Send ``blob`` (a whole file) to this rank's peer, receive those of the ranks whose peer this rank is."""
        if blob is None:
            return {}
        sizes = {s: torch.zeros(1, dtype=torch.int64) for s in self.sources}
        ops = [dist.P2POp(dist.isend, torch.tensor([len(blob)], dtype=torch.int64), self.peer, self.group)]
        ops += [dist.P2POp(dist.irecv, t, s, self.group) for s, t in sizes.items()]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        out = {s: torch.empty(int(t.item()), dtype=torch.uint8) for s, t in sizes.items()}
        ops = [dist.P2POp(dist.isend, torch.frombuffer(blob, dtype=torch.uint8), self.peer, self.group)]
        ops += [dist.P2POp(dist.irecv, t, s, self.group) for s, t in out.items()]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return {s: t.numpy() for s, t in out.items()}

    def remove(self, which) -> None:
        """Remove this node's local iterations ``it`` for which ``which(it)``. Never those a save may be
        writing: older ones after a save, newer ones than the state a run starts from before its first step."""
        if not os.path.isdir(self.dir):
            return
        for name in os.listdir(self.dir):
            if name.startswith("iter_") and name[5:].isdigit() and which(int(name[5:])):
                shutil.rmtree(os.path.join(self.dir, name), ignore_errors=True)

    # ----------------------------------------------------------------------------------------- restore
    def inventory(self) -> dict[int, dict[int, tuple[str, dict]]]:
        """What this node's directory holds: iteration -> rank -> (file, header). A node holds at most one
        copy of a rank's state: its own file on its own node, its replica on its peer's."""
        found: dict[int, dict[int, tuple[str, dict]]] = {}
        if not os.path.isdir(self.dir):
            return found
        for name in sorted(os.listdir(self.dir)):
            if not (name.startswith("iter_") and name[5:].isdigit()):
                continue
            for entry in sorted(os.listdir(os.path.join(self.dir, name))):
                if not entry.endswith(".pt"):
                    continue
                path = os.path.join(self.dir, name, entry)
                header = read_header(path)
                if header is None or header["file_bytes"] != header["payload_at"] + header["bytes"]:
                    continue  # not a complete file of this tier
                held = found.setdefault(int(header["iteration"]), {})
                if header["rank"] not in held or entry.startswith(OWN):
                    held[header["rank"]] = (path, header)
        return found

    def choose(self, shared_path: str | None) -> tuple[Choice | None, list[str]]:
        """Collective, before the model exists: the newest local iteration of this run, at this world size,
        for which every rank's state survives somewhere, if it is at least as new as the shared tier's
        ``latest`` (None: start from the shared tier). And one note for each newer local iteration passed over.

        The rule, and what it reads of the shared tier: rank 0 reads the shared ``latest`` pointer (a few
        bytes), nothing else. It must: the shared tier can be ahead of every local state (a shared save
        published by a process that wrote no local state at that iteration: a local save that failed, a
        ``local_interval`` that ``interval`` is not a multiple of, a launch without ``checkpoint.local_dir``),
        and the pointer is its one authority. The local tier is taken when it is at least as new (equal:
        the local read is the cheap one). What the run needs before it has a model (the model section it may
        adopt, the config its schedule and world size are checked against) comes from the header of rank 0's
        state in the local tier, not from the shared tier. The layout and the tensors themselves are checked
        once the model exists (:meth:`verify`)."""
        start = time.perf_counter()
        box = [files.latest_iteration(shared_path) if self.rank == 0 and shared_path else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        shared_iteration, shared_bytes = box[0] or (0, 0)
        keep = ("run", "layout", "signature", "bytes", "crc32", "payload_at", "small_bytes", "piece_crc32")
        inventory = self.inventory()
        mine = {it: {r: (path, {k: h[k] for k in keep}) for r, (path, h) in held.items()}
                for it, held in inventory.items()}
        everyone = [None] * self.world
        dist.all_gather_object(everyone, mine, group=self.group)
        notes = []
        for iteration in sorted({it for inv in everyone for it in inv}, reverse=True):
            if iteration < shared_iteration:
                notes.append(f"the shared tier's iteration {shared_iteration} is newer than the local tier's {iteration}")
                break
            # every file holding rank r's state, once per node (each rank of a node lists the same files), read
            # by the rank itself when on its node, else by the node's first rank; its own file before its
            # replica (and a file on its own node first: node ranks may change between launches)
            found = {}  # rank -> {(node, path): (the rank that reads it, path, header)}
            for reader, inv in enumerate(everyone):
                for r, (path, h) in inv.get(iteration, {}).items():
                    held = found.setdefault(r, {})
                    if (self.node_of[reader], path) not in held or reader == r:
                        held[self.node_of[reader], path] = (reader, path, h)
            copies = {r: sorted(held.values(), key=lambda c, r=r: (c[0] != r, not _is_own(c[1])))
                      for r, held in found.items()}
            lost = [r for r in range(self.world) if not copies.get(r)]
            if lost:
                notes.append(f"local iteration {iteration} is incomplete: the state of rank(s) {_ranks(lost)} "
                             f"survives on no node (neither its own file nor its replica)")
                continue
            headers = [copies[r][0][2] for r in range(self.world)]
            if any(h["run"] != self.run for h in headers):
                notes.append(f"local iteration {iteration} belongs to another run (saved to {headers[0]['run']})")
                continue
            saved_world = headers[0]["layout"].get("world_size")
            if saved_world != self.world:
                notes.append(f"local iteration {iteration} was saved at world size {saved_world}, this run has "
                             f"{self.world}: the local tier restores only at the same layout")
                continue
            # rank 0's header holds the metadata: whichever rank holds rank 0's first copy sends it
            holder = copies[0][0][0]
            box = [inventory[iteration][0][1].get("meta") if self.rank == holder else None]
            dist.broadcast_object_list(box, src=holder, group=self.group)
            return Choice(iteration, copies, box[0] or {}, shared_bytes, time.perf_counter() - start), notes
        return None, notes

    def verify(self, choice: Choice, layout: dict, expected: str) -> str | None:
        """Collective, once the model exists: None when ``choice`` holds this run's tensors at this layout
        (``expected``: this rank's :func:`signature`); else the line saying why not (every rank alike)."""
        signatures = [None] * self.world
        dist.all_gather_object(signatures, expected, group=self.group)
        headers = [choice.copies[r][0][2] for r in range(self.world)]
        if any(h["layout"] != layout for h in headers):
            saved = next(h["layout"] for h in headers if h["layout"] != layout)
            return (f"local iteration {choice.iteration} was saved at layout {_layout(saved)}, this run is "
                    f"{_layout(layout)}: the local tier restores only at the same layout")
        differ = [r for r in range(self.world) if headers[r]["signature"] != signatures[r]]
        if differ:
            return (f"local iteration {choice.iteration} holds other tensors than this run on rank(s) "
                    f"{_ranks(differ)} (another sharding level, precision or model)")
        return None

    def restore(self, choice: Choice, live: RankState) -> tuple[LocalRestore | None, list[str]]:
        """Collective: read every rank's state where ``choice`` says, send it to its rank and load it into the
        tensors of ``live`` (checked by :meth:`verify`); the replicated tensors' pieces are gathered over their
        data-parallel group. A copy that cannot be read or fails its checksum is passed over for the next copy
        of the same state (its replica), with a note; when no copy of some rank's state is intact, None (load
        the shared tier). Nothing is loaded until every rank's state has been read intact."""
        using = {r: 0 for r in range(self.world)}  # rank -> the index of the copy of its state being read
        reads, nbytes, notes = {}, 0, []
        while True:
            problems = {}
            for r, at in using.items():
                reader, path, h = choice.copies[r][at]
                if reader != self.rank or r in reads:
                    continue
                try:
                    data = torch.empty(h["bytes"], dtype=torch.uint8)
                    with open(path, "rb", buffering=0) as f:  # straight into ``data``: no intermediate copy
                        f.seek(h["payload_at"])
                        got = _read_into(f, memoryview(data.numpy()))
                    nbytes += got
                    if zlib.crc32(data.numpy()) != h["crc32"]:
                        raise ValueError("corrupted: its checksum differs from the one recorded at save time")
                    reads[r] = data
                except (OSError, ValueError) as e:
                    problems[r] = f"{path} on node {node_rank()}: {e}"
            gathered = [None] * self.world
            dist.all_gather_object(gathered, problems, group=self.group)
            failed = {r: p for g in gathered for r, p in g.items()}
            if not failed:
                break
            for r, problem in sorted(failed.items()):
                using[r] += 1
                if using[r] < len(choice.copies[r]):
                    other = "another copy of it" if _is_own(choice.copies[r][using[r]][1]) else "its replica"
                    notes.append(f"the local copy of rank {r}'s state {problem}; reading {other} instead")
                else:
                    notes.append(f"the local copy of rank {r}'s state {problem}, and no other copy of it survives: "
                                 f"local iteration {choice.iteration} cannot be restored")
                    return None, notes
        ops = [dist.P2POp(dist.isend, data, r, self.group) for r, data in reads.items() if r != self.rank]
        reader, _, header = choice.copies[self.rank][using[self.rank]]
        data = reads.get(self.rank)
        if reader != self.rank:
            data = torch.empty(header["bytes"], dtype=torch.uint8)
            ops.append(dist.P2POp(dist.irecv, data, reader, self.group))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        small = data[len(data) - header["small_bytes"]:].numpy().tobytes()
        state = torch.load(io.BytesIO(small), weights_only=True, map_location="cpu")
        nbytes += self._load(data, live, choice)
        box = [state["common"]]
        dist.broadcast_object_list(box, src=0, group=self.group)
        total = torch.tensor([nbytes], dtype=torch.int64)
        dist.all_reduce(total, group=self.group)
        replicas = [r for r in range(self.world) if not _is_own(choice.copies[r][using[r]][1])]
        return LocalRestore(choice.iteration, state, box[0], int(total.item()), replicas), notes

    def _load(self, data: torch.Tensor, live: RankState, choice: Choice) -> int:
        """Copy this rank's payload ``data`` into ``live``'s tensors; the replicated ones from the pieces of
        every rank of their group: read from this node's disk when it holds a copy of each (its own files and
        the replicas it keeps: with two nodes, every piece), each checked against its own checksum; else, or
        when any rank could not, gathered over the group (collective over the whole tier: the groups are made
        alike, and every rank takes the same way). Returns the bytes read here."""
        where = _Layout.of(live, self.rank)
        every = [None] * self.world
        dist.all_gather_object(every, live.group, group=self.group)
        group = self._gloo_group(live.group, every)
        with torch.no_grad():
            for k in where.unique:
                t, at = live.tensors[k], where.offsets[k]
                t.copy_(data[at:at + _nbytes(t)].view(t.dtype).view(t.shape))
            if group is None:
                return 0
            flat = torch.empty(where.size * where.piece, dtype=torch.uint8)
            pieces = list(flat.view(where.size, where.piece).unbind(0))
            # the same on every rank: does every rank's node hold a copy of each piece its group needs
            here = all(any(self.node_of[reader] == self.node_of[x] for reader, _, _ in choice.copies[r])
                       for x in range(self.world) for r in every[x] if r != x)
            nbytes = 0
            for j, r in enumerate(live.group):
                n = min((j + 1) * where.piece, where.replicated_bytes) - min(j * where.piece, where.replicated_bytes)
                if r == self.rank:
                    pieces[j][:n] = data[where.unique_bytes:where.unique_bytes + n]
                    continue
                mine = [(path, h) for reader, path, h in choice.copies[r] if self.node_of[reader] == self.node_of[self.rank]]
                if here:
                    path, h = mine[0]
                    try:
                        with open(path, "rb", buffering=0) as f:
                            f.seek(h["payload_at"] + where.unique_bytes)
                            nbytes += _read_into(f, memoryview(pieces[j].numpy())[:n])
                        here = zlib.crc32(pieces[j][:n].numpy()) == h["piece_crc32"]
                    except (OSError, ValueError):
                        here = False
            everywhere = [None] * self.world
            dist.all_gather_object(everywhere, here, group=self.group)
            if not all(everywhere):
                dist.all_gather(pieces, pieces[where.index].clone(), group=group)
            for k in where.replicated:
                t, at = live.tensors[k], where.offsets[k]
                t.copy_(flat[at:at + _nbytes(t)].view(t.dtype).view(t.shape))
        return nbytes

    def _gloo_group(self, ranks: tuple[int, ...], every: list):
        """A gloo group of ``ranks`` (this rank's data-parallel group), or None when it has no replicated
        state. Collective over the tier (``every``: each rank's group): every rank makes every group, in
        the same order."""
        mine = None
        for group in sorted({g for g in every if g}):
            made = self._groups.get(group)
            if made is None:
                made = self._groups[group] = dist.new_group(list(group), backend="gloo", timeout=self.timeout)
            if group == ranks:
                mine = made
        return mine


def _read_into(f, view: memoryview) -> int:
    """Fill ``view`` from ``f``; ValueError when the file ends first."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise ValueError(f"truncated: {got} of {len(view)} bytes")
        got += n
    return got


def _is_own(path: str) -> bool:
    """Whether the local-tier file ``path`` is a rank's own (not a replica received from another node)."""
    return os.path.basename(path).startswith(OWN)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def _layout(layout: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in layout.items())
