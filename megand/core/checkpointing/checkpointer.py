"""Save and load a run's full state, sharded and layout-free, with atomic and optionally asynchronous saves.

Save (every rank, collectively):
  1. wait for the previous asynchronous save;
  2. the pieces of model and optimizer state are staged on the host (device tensors into page-locked
     buffers with one wait; host tensors copied when asynchronous: staging.py), with the RNG states and
     the scalars; then, in the save's thread (training goes on when asynchronous):
  3. rank 0 makes ``iter_N.tmp/``; each rank writes its RNG file, rank 0 ``common.pt`` and ``config.yaml``;
     the pieces are written with torch.distributed.checkpoint;
  4. each rank checksums the files it wrote (every file is in the manifest); rank 0 writes it, renames ``iter_N.tmp`` to
     ``iter_N`` and then atomically replaces ``latest`` - only after every rank has finished writing.
A crash anywhere before step 4 leaves ``latest`` and the previous checkpoint untouched. A write that fails
(disk full, file-size limit, quota, read-only directory) is agreed on by every rank after each step:
the partial ``iter_N.tmp`` is removed and every rank raises :class:`CheckpointWriteError` naming the
path and the OS error. Steps 2-4 run in a thread of the save's own (a synchronous save waits for it), so a
save that runs over its time budget (``budget_s``: a write blocked on a stalled filesystem) is a failed
save too: every rank abandons it (it can no longer publish) and the run's next save uses a fresh group.
After a successful publish, ``keep_last`` removes the oldest ``iter_*`` directories beyond that number
(never the one ``latest`` names); this runs inside the save that published, so never while another save
is being written.

Load: resolve the directory, check metadata, files and every tensor's full shape against this run's
model (so a bad checkpoint fails before training with a message naming the file or tensor), then read
each rank's pieces, whatever layout wrote them.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from megand.core.checkpointing import files, rng, sharded
from megand.core.checkpointing.config import CheckpointConfig
from megand.core.checkpointing.errors import CheckpointWriteError, describe_write_error
from megand.core.checkpointing.files import CheckpointError
from megand.core.checkpointing.pieces import PieceLoadPlanner, PieceSavePlanner
from megand.core.checkpointing.staging import HostStaging
from megand.core.optimizer.registry import state_names


@dataclass
class LoadedState:
    iteration: int
    consumed_samples: int
    run_id: str | None
    path: str
    optimizer_loaded: bool
    rng_restored: bool
    extra_state: dict | None = None  # what the trainer stored with the save (opaque here)
    rng_notice: str | None = None  # why some random streams were re-seeded rather than restored
    tier: str = "shared"  # where it came from: the shared save directory, or the node-local tier
    bytes_read: dict | None = None  # tier -> bytes read from it by all ranks together
    seconds: float = 0.0
    from_replica: tuple[int, ...] = ()  # local tier: the ranks whose state came from a peer's replica
    config: str | None = None  # local tier: the saved run's config (YAML; the shared tier's is its config.yaml)


def layout_of(topo) -> dict:
    return {"tp": topo.tp_size, "cp": topo.cp_size, "dp": topo.dp_size, "pp": topo.pp_size, "vpp": topo.vpp,
            "order": topo.order, "world_size": topo.world_size}


def write_torch(obj, path: str) -> None:
    """torch.save through a plain file write, so a failed write reports the OS error and the path
    (torch's zip writer reports a short write only as a position mismatch)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    with open(path, "wb") as f:
        f.write(buffer.getbuffer())


class _Save:
    """One save being written by a thread of its own (daemon: a save that ran over its budget is abandoned,
    never joined; a stuck write cannot then keep the process from exiting)."""

    def __init__(self, iteration: int, tmp: str, group, work):
        self.iteration, self.tmp = iteration, tmp
        self.group = group  # its collectives' group: an abandoned save never touches the next saves' one
        self.started = time.monotonic()
        self.cancelled = threading.Event()  # set when abandoned: it must not publish any more
        self.future: Future = Future()
        self.thread = threading.Thread(target=self._run, args=(work,), name="megand-ckpt", daemon=True)
        self.thread.start()

    def _run(self, work) -> None:
        try:
            self.future.set_result(work(self))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread whatever it is
            self.future.set_exception(e)


class Checkpointer:
    def __init__(self, config: CheckpointConfig, topo, named_params, optimizer, chunks, config_yaml: str,
                 model_cfg: dict, local=None):
        """``local``: the node-local tier (a LocalTier, opened before the model exists), or None."""
        self.cfg, self.topo, self.optimizer = config, topo, optimizer
        self.named_params = list(named_params)
        self.named_buffers = sharded.state_buffers(chunks)
        self.rngs = rng.tp_rngs(chunks)
        self.config_yaml, self.model_cfg = config_yaml, model_cfg
        # A group of its own (gloo, CPU) so a background save never interleaves with training collectives;
        # replaced after a save abandoned mid-collective. Each save's outcome is agreed on in another,
        # which no abandoned save ever uses.
        self.group = self._new_group()
        self.outcome_group = self._new_group()
        self.rank = dist.get_rank()
        self.pending: _Save | None = None
        self.abandoned: list[_Save] = []  # saves over their budget whose threads may still be in a collective
        self.staging = HostStaging()
        self.last_saved = None
        self.last_stall_s = 0.0
        self.local = local
        if hasattr(signal, "SIGXFSZ"):  # over a file-size limit a write must fail (EFBIG), not kill the rank
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    def _new_group(self):
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=self.cfg.timeout_s))

    # ----------------------------------------------------------------------------------------- save
    @property
    def pending_iteration(self) -> int | None:
        """The iteration of the save still being written (asynchronous), whose outcome :meth:`wait` gives."""
        return self.pending.iteration if self.pending is not None else None

    def save(self, iteration: int, consumed_samples: int, run_id: str | None = None, global_batch_size=None,
             extra_state: dict | None = None) -> None:
        """Collective. ``extra_state``: rank 0's plain Python values (dicts, lists, numbers, strings), kept
        as they are and returned by :meth:`load` (e.g. the data sources' and the guards' state).

        The state is captured here (staged on the host) and written by a thread of its own; a synchronous
        save waits for it. Raises CheckpointWriteError (on every rank alike) when a write fails anywhere
        or the save runs over ``budget_s``; an asynchronous save's failure is raised by :meth:`wait` (call
        it first to know the previous save's outcome: ``save`` waits for it and raises it too)."""
        start = time.perf_counter()
        self.wait()
        tmp = os.path.join(self.cfg.save, files.iter_dir_name(iteration) + ".tmp")
        rng_state = rng.capture(self.rngs, self.topo.device)
        common = self._common(iteration, consumed_samples, run_id, global_batch_size, extra_state)
        self.optimizer.ddp.finish_param_sync()  # overlapped parameter all-gathers must land first
        state = self.staging.stage(sharded.save_pieces(self.named_params, self.optimizer, self.named_buffers),
                                   copy=self.cfg.async_save)
        self.pending = _Save(iteration, tmp, self.group, lambda save: self._write(save, state, rng_state, common))
        if not self.cfg.async_save:
            self.wait()
        self.last_saved = iteration
        self.last_stall_s = time.perf_counter() - start

    def _common(self, iteration, consumed_samples, run_id, global_batch_size, extra_state) -> dict | None:
        """Rank 0's part of a save: the run's scalars (None on the other ranks)."""
        return {"format": files.FORMAT, "iteration": iteration, "consumed_samples": consumed_samples,
                "global_batch_size": global_batch_size, "optimizer": self.optimizer.scalar_state(),
                "run_id": run_id, "layout": layout_of(self.topo), "model": self.model_cfg,
                "extra": extra_state} if self.rank == 0 else None

    def _local_tensors(self) -> dict:
        from megand.core.checkpointing.local_tier import rank_tensors

        return rank_tensors(self.named_params, self.optimizer, self.named_buffers)

    def save_local(self, iteration: int, consumed_samples: int, run_id: str | None = None, global_batch_size=None,
                   extra_state: dict | None = None) -> None:
        """Collective: a save to the node-local tier (synchronous; :meth:`save`'s arguments). Raises
        CheckpointWriteError on every rank alike when a write failed anywhere."""
        self.optimizer.ddp.finish_param_sync()
        common = self._common(iteration, consumed_samples, run_id, global_batch_size, extra_state)
        meta = {"model": self.model_cfg, "config": self.config_yaml} if self.rank == 0 else None
        self.local.save(iteration, self._local_tensors(), rng.capture(self.rngs, self.topo.device), common,
                        layout_of(self.topo), meta)

    def restore_local(self, choice) -> tuple[LoadedState | None, list[str]]:
        """Collective: the local tier's state ``choice`` (LocalTier.choose's) loaded, or None when it holds
        other tensors or another layout than this run, or when some rank's state has no intact copy left;
        and the lines saying why. Every rank alike; nothing is changed unless it is loaded."""
        from megand.core.checkpointing.local_tier import signature

        start = time.perf_counter()
        layout = layout_of(self.topo)
        self.optimizer.ddp.finish_param_sync()
        live = self._local_tensors()
        mismatch = self.local.verify(choice, layout, signature(live, layout))
        if mismatch:
            return None, [mismatch]
        got, notes = self.local.restore(choice, live)
        if got is None:
            return None, notes
        rng_notice = rng.restore(got.state["rng"], self.rngs, self.topo.device)
        common = got.common
        self.optimizer.load_scalar_state(common["optimizer"])
        loaded = LoadedState(int(common["iteration"]), int(common.get("consumed_samples", 0)), common.get("run_id"),
                             os.path.join(self.local.dir, files.iter_dir_name(got.iteration)), True, rng_notice is None,
                             extra_state=common.get("extra"), rng_notice=rng_notice, tier="local",
                             bytes_read={"local": got.bytes_read, "shared": choice.shared_bytes},  # shared: ``latest``
                             seconds=choice.seconds + time.perf_counter() - start, from_replica=tuple(got.from_replica),
                             config=choice.meta.get("config"))
        return loaded, notes

    def _write(self, save: _Save, state, rng_state, common) -> None:
        """The save's steps, each agreed on by every rank (in the save's thread)."""
        tmp = save.tmp

        def make_dir():
            if self.rank == 0:
                if os.path.exists(tmp):  # left over by a crashed save
                    shutil.rmtree(tmp)
                os.makedirs(os.path.join(tmp, "rng"))

        self._agree(save, make_dir)

        def write_small_files():
            write_torch(rng_state, os.path.join(tmp, "rng", f"rank_{self.rank:05d}.pt"))
            if self.rank == 0:
                write_torch(common, os.path.join(tmp, files.COMMON))
                with open(os.path.join(tmp, files.CONFIG), "w") as f:
                    f.write(self.config_yaml)

        self._agree(save, write_small_files)
        self._agree(save, lambda: dcp.save({}, storage_writer=FileSystemWriter(tmp), planner=PieceSavePlanner(state),
                                           process_group=save.group))
        crcs = {}

        def checksum():
            mine = [n for n in os.listdir(tmp) if n.startswith(f"__{self.rank}_") and n.endswith(".distcp")]
            # every file of the checkpoint is checksummed: its own RNG file on each rank, the rest on rank 0
            mine.append(os.path.join("rng", f"rank_{self.rank:05d}.pt"))
            if self.rank == 0:
                mine += [files.COMMON, files.CONFIG, files.METADATA]
            crcs.update({n: files.file_crc(os.path.join(tmp, n)) for n in mine})

        self._agree(save, checksum)
        gathered = [None] * dist.get_world_size(save.group) if self.rank == 0 else None
        dist.gather_object(crcs, gathered, dst=0, group=save.group)  # every rank has finished writing

        def publish():
            if self.rank == 0:
                if save.cancelled.is_set():  # abandoned (over its budget): its directory is being removed
                    raise CheckpointWriteError("abandoned after its time budget")
                merged = {k: v for d in gathered for k, v in d.items()}
                with open(os.path.join(tmp, files.MANIFEST), "w") as f:
                    json.dump({"crc32": merged}, f)
                self._publish(tmp, save.iteration)

        self._agree(save, publish)
        if self.rank == 0 and self.cfg.keep_last:
            self._remove_old(self.cfg.keep_last, save.iteration)
        dist.barrier(group=save.group)

    def _failure(self, path: str, problems: list[str]) -> CheckpointWriteError:
        latest = os.path.join(self.cfg.save, files.LATEST)
        kept = f"{latest} still names the previous checkpoint" if os.path.isfile(latest) else "no checkpoint was published"
        return CheckpointWriteError(f"saving {path} failed: {problems[0]}"
                                    + (f" (and {len(problems) - 1} other rank(s))" if len(problems) > 1 else "")
                                    + f"; {kept}")

    def _agree(self, save: _Save, local_step) -> None:
        """Run this rank's part of a save step, then agree with every rank on whether all succeeded. On
        a failure anywhere the partial directory is removed and every rank raises the same error. An
        abandoned save stops at its next step."""
        if save.cancelled.is_set():
            raise CheckpointWriteError("abandoned after its time budget")
        path = save.tmp
        try:
            local_step()
            problem = None
        except BaseException as e:  # noqa: BLE001 - DCP raises a BaseException subclass
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            problem = f"rank {self.rank}: {describe_write_error(e, self.cfg.save)}"
        problems = [None] * dist.get_world_size(save.group)
        dist.all_gather_object(problems, problem, group=save.group)
        problems = [p for p in problems if p]
        if problems:
            if self.rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            raise self._failure(path, problems)

    def _remove_old(self, keep: int, newest: int) -> None:
        """Delete the oldest complete ``iter_*`` directories beyond ``keep`` (never ``newest``, the one
        ``latest`` names now)."""
        root = self.cfg.save
        done = sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("iter_") and n[5:].isdigit())
        for it in [i for i in done if i != newest][:max(0, len(done) - keep)]:
            shutil.rmtree(os.path.join(root, files.iter_dir_name(it)), ignore_errors=True)

    def _publish(self, tmp: str, iteration: int) -> None:
        root = self.cfg.save
        final = os.path.join(root, files.iter_dir_name(iteration))
        files.fsync_dir(tmp)
        old = None
        if os.path.exists(final):  # the same iteration saved again (a resumed run)
            old = f"{final}.old{os.getpid()}"
            os.rename(final, old)
        os.rename(tmp, final)
        files.fsync_dir(root)
        files.atomic_write_text(os.path.join(root, files.LATEST), f"{iteration}\n")
        if old:
            shutil.rmtree(old, ignore_errors=True)

    def wait(self) -> None:
        """Collective when a save is pending (every rank has the same one): wait for it, at most until
        ``budget_s`` after it started, and agree on its outcome with every rank. Raises CheckpointWriteError
        on every rank alike when it failed anywhere or ran over its budget; such a save is abandoned: its
        thread may still be blocked in a write, but it publishes nothing, and its partial directory is
        removed."""
        if self.pending is None:
            return
        save, self.pending = self.pending, None
        budget = self.cfg.budget_s
        problem, late = None, False
        try:
            save.future.result(timeout=None if budget is None else max(0.0, save.started + budget - time.monotonic()))
        except FutureTimeout:
            problem, late = f"rank {self.rank}: not finished within its budget of {budget:g} s", True
        except CheckpointWriteError as e:  # already agreed on by every rank: its message is complete
            problem = str(e)
        except Exception as e:  # noqa: BLE001 - e.g. a collective of the save that failed (a peer's timeout)
            problem = f"rank {self.rank}: {describe_write_error(e, self.cfg.save)}"
        outcomes = [None] * dist.get_world_size(self.outcome_group)
        dist.all_gather_object(outcomes, (problem, late), group=self.outcome_group)
        if any(late for _, late in outcomes):
            save.cancelled.set()
            self.abandoned.append(save)
            if self.rank == 0:
                self._remove_abandoned(save.tmp)
            # the abandoned threads may be inside a collective of the save group: the next saves use another
            self.group = self._new_group()
        problems = [p for p, _ in outcomes if p]
        if problems:
            agreed = next((p for p in problems if p.startswith("saving ")), None)
            raise CheckpointWriteError(agreed) if agreed else self._failure(save.tmp, problems)

    @staticmethod
    def _remove_abandoned(tmp: str) -> None:
        """Remove an abandoned save's directory. Renaming it away first decides the race with its own
        thread's publish, which renames it too: whichever rename comes first wins. Lost (the thread was
        publishing already), the directory is complete, whether or not ``latest`` gets to name it."""
        gone = f"{tmp}.abandoned"
        try:
            os.rename(tmp, gone)
        except FileNotFoundError:
            return
        shutil.rmtree(gone, ignore_errors=True)

    def close(self) -> None:
        """Wait for the pending save; then for the abandoned saves' threads to leave their collectives
        (each began before ``budget_s`` ran out and ends by the group's timeout ``timeout_s``: destroying a
        gloo group while one of its operations runs aborts the process). A thread blocked in a write stays, harmless at exit."""
        self.wait()
        for save in self.abandoned:
            ends = save.started + (self.cfg.budget_s or 0.0) + self.cfg.timeout_s  # its last collective's timeout
            save.thread.join(max(0.0, ends + 5.0 - time.monotonic()))
        self.abandoned = []

    # ----------------------------------------------------------------------------------------- load
    def _check_files_together(self, iter_dir, metadata) -> None:
        """Each rank checksums a share of the files; every rank raises the same error if any fails."""
        world = dist.get_world_size(self.group)
        self._agreed(lambda: files.check_files(iter_dir, metadata, part=(dist.get_rank(self.group), world)))

    def _agreed(self, local_check):
        """``local_check()``'s result; if it raised CheckpointError on any rank, every rank raises the first."""
        result, problem = None, None
        try:
            result = local_check()
        except CheckpointError as e:
            problem = str(e)
        problems = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(problems, problem, group=self.group)
        problems = [p for p in problems if p]
        if problems:
            raise CheckpointError(problems[0])
        return result

    def load(self, path: str) -> LoadedState:
        start = time.perf_counter()
        iter_dir = files.resolve(path)
        metadata = files.read_metadata(iter_dir)
        self._check_files_together(iter_dir, metadata)  # checksums first: nothing read below can be damaged
        common = files.read_common(iter_dir)
        keys = set(metadata.state_dict_metadata)
        expected = sharded.expected_full_shapes(self.named_params, self.optimizer, self.named_buffers)
        has_optimizer = any(k.startswith("optim.") for k in keys)
        # model weights always; optimizer states when the checkpoint has any (an imported HF model has
        # none); an fp32 ``main`` copy is optional (absent from fp32 runs)
        required = {k for k in expected if k.startswith("model.") or (has_optimizer and not k.endswith(".main"))}
        states = tuple(f".{name}" for name in state_names())
        other = sorted(k for k in required - keys if k.endswith(states))
        if other:  # e.g. Adam moments saved where this run keeps Muon's momentum, or the reverse
            raise CheckpointError(f"{iter_dir} holds the state of another optimizer: {other[0]} is missing (a run "
                                  f"saved with one optim.name resumed with another); resume with the optimizer "
                                  f"the checkpoint was saved with")
        files.check_shapes(iter_dir, metadata, expected, required)
        files.check_model_config(iter_dir, common.get("model"), self.model_cfg)

        # read in place into the parameters and this rank's optimizer shard; the fp32 master copies from
        # the saved ones, else from the weights (a model-only or fp32 checkpoint)
        self.optimizer.ddp.finish_param_sync()
        pieces = sharded.load_pieces(self.named_params, self.optimizer, keys, with_optimizer=has_optimizer,
                                     named_buffers=self.named_buffers)
        try:
            dcp.load({}, storage_reader=FileSystemReader(iter_dir), planner=PieceLoadPlanner(pieces),
                     process_group=self.group)
        except Exception as e:  # noqa: BLE001 - name the checkpoint in whatever DCP raised
            raise CheckpointError(f"{iter_dir}: reading the checkpoint failed: {type(e).__name__}: {e}") from e
        if has_optimizer:
            self.optimizer.load_scalar_state(common["optimizer"])
        rng_restored, rng_notice = False, None
        rng_file = os.path.join(iter_dir, "rng", f"rank_{self.rank:05d}.pt")
        if common.get("layout") == layout_of(self.topo) and os.path.isfile(rng_file):
            state = self._agreed(lambda: rng.read(rng_file))  # a refused file stops every rank alike
            rng_notice = rng.restore(state, self.rngs, self.topo.device)
            rng_restored = rng_notice is None
        dist.barrier(group=self.group)
        # every file is read at least once (its checksum, shared among the ranks), the data then by its readers
        size = sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(iter_dir) for n in names)
        return LoadedState(int(common["iteration"]), int(common.get("consumed_samples", 0)), common.get("run_id"),
                           iter_dir, has_optimizer, rng_restored, extra_state=common.get("extra"), rng_notice=rng_notice,
                           bytes_read={"shared": size}, seconds=time.perf_counter() - start)
