"""The on-disk layout of checkpoints and the checks made before anything is loaded.

    ${save}/iter_0000100/          .metadata + __<rank>_<n>.distcp (torch.distributed.checkpoint)
                                   common.pt (iteration, consumed samples, scalars, layout, run id)
                                   rng/rank_00003.pt (per-rank RNG states), config.yaml, manifest.json
    ${save}/iter_0000100.tmp/      a save in progress (or one that crashed): never loaded
    ${save}/latest                 the last complete iteration, replaced atomically
"""

from __future__ import annotations

import json
import os
import zlib

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

LATEST = "latest"
COMMON = "common.pt"
CONFIG = "config.yaml"
MANIFEST = "manifest.json"
METADATA = ".metadata"
FORMAT = 1


from megand.core.checkpointing.errors import CheckpointError  # noqa: E402  (re-exported)
from megand.core.transformer.config import ARCHITECTURE_FIELDS, comparable  # noqa: E402


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_crc(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def latest_iteration(save: str) -> tuple[int, int] | None:
    """``(iteration, bytes read)`` of the ``latest`` file of the save directory ``save``; None when it has
    none or it does not hold a number."""
    try:
        with open(os.path.join(save, LATEST), "rb") as f:
            raw = f.read()
        return int(raw.strip()), len(raw)
    except (OSError, ValueError):
        return None


def resolve(path: str) -> str:
    """The complete iteration directory that ``checkpoint.load=path`` designates, or CheckpointError.

    ``path`` is a save directory (holding ``latest``) or an iteration directory."""
    if not path or not os.path.exists(path):
        raise CheckpointError(f"checkpoint.load={path}: no such directory")
    if path.rstrip("/").endswith(".tmp"):
        raise CheckpointError(f"checkpoint.load={path}: a partial checkpoint (a save that did not finish)")
    latest = os.path.join(path, LATEST)
    if os.path.isfile(latest):
        with open(latest) as f:
            text = f.read().strip()
        try:
            iteration = int(text)
        except ValueError:
            raise CheckpointError(f"{latest}: corrupted, expected an iteration number, found {text[:40]!r}") from None
        target = os.path.join(path, iter_dir_name(iteration))
        if not os.path.isdir(target):
            raise CheckpointError(f"{latest} names iteration {iteration} but {target} does not exist")
        path = target
    if not os.path.isfile(os.path.join(path, METADATA)):
        partial = sorted(n for n in os.listdir(path) if n.endswith(".tmp")) if os.path.isdir(path) else []
        hint = f" (only partial saves: {', '.join(partial)})" if partial else ""
        raise CheckpointError(f"checkpoint.load={path}: not a complete checkpoint: no {LATEST} file and no "
                              f"{os.path.join(path, METADATA)}{hint}")
    return path


def read_metadata(iter_dir: str):
    try:
        return FileSystemReader(iter_dir).read_metadata()
    except Exception as e:  # noqa: BLE001 - any failure to parse means a damaged file
        raise CheckpointError(f"{os.path.join(iter_dir, METADATA)}: corrupted, cannot be read ({type(e).__name__}: {e})") from None


def read_common(iter_dir: str) -> dict:
    path = os.path.join(iter_dir, COMMON)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing (partial checkpoint)")
    try:
        common = torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{path}: corrupted, cannot be read ({type(e).__name__}: {e})") from None
    if common.get("format") != FORMAT:
        raise CheckpointError(f"{path}: unknown checkpoint format {common.get('format')!r} (expected {FORMAT})")
    return common


def check_files(iter_dir: str, metadata, verify_crc: bool = True, part: tuple[int, int] = (0, 1)) -> None:
    """Every data file the metadata refers to exists, is long enough, and (if a manifest was written) has
    the checksum recorded at save time. ``part=(i, n)``: checksum only every n-th file from the i-th (the
    ranks of a job share the reading)."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(needed.items()):
        path = os.path.join(iter_dir, rel)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing data file (partial checkpoint)")
        found = os.path.getsize(path)
        if found < size:
            raise CheckpointError(f"{path}: corrupted (truncated): expected at least {size} bytes, found {found}")
    manifest = os.path.join(iter_dir, MANIFEST)
    if verify_crc and os.path.isfile(manifest):
        with open(manifest) as f:
            crcs = json.load(f)["crc32"]
        for rel, crc in sorted(crcs.items())[part[0]::part[1]]:
            if not os.path.isfile(os.path.join(iter_dir, rel)):
                raise CheckpointError(f"{os.path.join(iter_dir, rel)}: missing (listed in {MANIFEST})")
            got = file_crc(os.path.join(iter_dir, rel))
            if got != crc:
                raise CheckpointError(f"{os.path.join(iter_dir, rel)}: corrupted: checksum {got:08x}, "
                                      f"expected {crc:08x} (recorded at save time)")


def check_shapes(iter_dir: str, metadata, expected: dict[str, tuple[int, ...]], required: set[str]) -> None:
    """Every key in ``required`` exists; every expected key present has the expected full shape."""
    stored = metadata.state_dict_metadata
    problems = []
    for key, shape in sorted(expected.items()):
        md = stored.get(key)
        if md is None:
            if key in required:
                problems.append(f"tensor {key} (shape {tuple(shape)}) is missing from the checkpoint")
        elif not isinstance(md, TensorStorageMetadata):
            problems.append(f"{key} is not a tensor in the checkpoint")
        elif tuple(md.size) != tuple(shape):
            problems.append(f"tensor {key}: expected shape {tuple(shape)}, checkpoint has {tuple(md.size)}")
    if problems:
        more = f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
        raise CheckpointError(f"{iter_dir} does not fit this model (a different model shape?): "
                              + "; ".join(problems[:5]) + more)


# every key that shapes the weights or what they compute (the model schema's architecture keys)
STRUCTURE_KEYS = tuple(sorted(ARCHITECTURE_FIELDS))


def check_model_config(iter_dir: str, saved: dict | None, current: dict) -> None:
    if not saved:
        return
    present = set(saved)
    saved, current = comparable(saved), comparable(current)
    diffs = [f"model.{k}: checkpoint {saved.get(k)!r}, this run {current.get(k)!r}"
             for k in STRUCTURE_KEYS if k in present and saved.get(k) != current.get(k)]
    if diffs:
        raise CheckpointError(f"{iter_dir} holds a different model: " + "; ".join(diffs))
