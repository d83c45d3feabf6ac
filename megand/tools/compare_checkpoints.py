"""Compare two megand checkpoints tensor by tensor, whatever layouts and sharding levels wrote them.

    python tools/compare_checkpoints.py A B [--grads] [--rtol 5e-6] [--top 20] [--json]

A and B are save directories (their ``latest``) or iteration directories. Every tensor both hold (model
weights ``model.*`` and optimizer state ``optim.*``) is read full-size, a batch of at most
``--batch-mib`` at a time from each side, through torch.distributed.checkpoint, which assembles it from
whatever pieces the writing layout left. Each tensor gets the largest absolute difference, the relative
difference ``||A - B|| / ||B||`` (the correctness protocol's per-tensor measure) and the cosine similarity;
the rows are printed worst first. ``--grads`` compares only each parameter's first moment, which after
step 1 is linear in its gradient (AdamW's ``exp_avg = (1 - beta1) g``): between a parallel layout and the
one-process run of the same step it must agree within 5e-6, so the first rows name the parameter whose
gradient a layout gets wrong. Exit 1 when a tensor's relative difference is above ``--rtol`` (or a tensor
is missing on one side or differs in shape); exit 2 when a checkpoint cannot be read.

A data file whose checksum differs from the one recorded at save time is reported, and its tensors are
compared anyway (a damaged file is one of the things this finds).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass

import torch

CHUNK = 1 << 22  # elements per slice of the statistics (bounds the float64 temporaries)


@dataclass
class Row:
    key: str
    shape: tuple
    max_abs: float
    rel: float  # ||a - b|| / ||b||; inf when only one side has the tensor or the shapes differ
    cosine: float
    note: str = ""


def stats(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float]:
    """(max |a - b|, ||a - b|| / ||b||, cosine(a, b)) in float64, a slice at a time."""
    a, b = a.reshape(-1), b.reshape(-1)
    max_abs, diff2, a2, b2, ab = 0.0, 0.0, 0.0, 0.0, 0.0
    for lo in range(0, a.numel(), CHUNK):
        x, y = a[lo:lo + CHUNK].double(), b[lo:lo + CHUNK].double()
        d = x - y
        max_abs = max(max_abs, float(d.abs().max()))
        diff2 += float(d.square().sum())
        a2, b2, ab = a2 + float(x.square().sum()), b2 + float(y.square().sum()), ab + float((x * y).sum())
    if diff2 == 0.0:
        return max_abs, 0.0, 1.0
    rel = math.sqrt(diff2) / math.sqrt(b2) if b2 > 0 else math.inf
    cosine = ab / math.sqrt(a2 * b2) if a2 > 0 and b2 > 0 else 0.0
    return max_abs, rel, cosine


def first_moment_keys(keys) -> list[str]:
    """The first-moment state of every parameter (each optimizer record names its own)."""
    from megand.core.optimizer.registry import OPTIMIZERS

    names = {r.first_moment for r in OPTIMIZERS.values() if r.first_moment}
    return [k for k in keys if k.startswith("optim.") and k.rsplit(".", 1)[-1] in names]


def damaged_files(iter_dir: str) -> list[str]:
    """The data files whose checksum differs from the one recorded at save time."""
    from megand.core.checkpointing import files

    manifest = os.path.join(iter_dir, files.MANIFEST)
    if not os.path.isfile(manifest):
        return []
    with open(manifest) as f:
        crcs = json.load(f)["crc32"]
    return sorted(rel for rel, crc in crcs.items()
                  if not os.path.isfile(os.path.join(iter_dir, rel)) or files.file_crc(os.path.join(iter_dir, rel)) != crc)


def batches(keys, shapes, budget_bytes: int):
    """``keys`` in groups of at most ``budget_bytes`` (a larger tensor alone)."""
    group, size = [], 0
    for key in keys:
        shape, dtype = shapes[key]
        nbytes = math.prod(shape) * dtype.itemsize
        if group and size + nbytes > budget_bytes:
            yield group
            group, size = [], 0
        group.append(key)
        size += nbytes
    if group:
        yield group


def compare(a: str, b: str, grads: bool = False, batch_mib: int = 512) -> tuple[list[Row], dict]:
    """Every row, worst first, and what the checkpoints are (their directories, iterations, layouts and
    damaged files). Raises CheckpointError when either cannot be read."""
    from megand.core.checkpointing import files, offline

    dirs = [files.resolve(a), files.resolve(b)]
    shapes = []
    for d in dirs:
        metadata = files.read_metadata(d)
        files.check_files(d, metadata, verify_crc=False)  # present and long enough; checksums reported below
        shapes.append(offline.tensor_shapes_of(metadata, prefix=""))
    info = {"dirs": dirs, "damaged": [[os.path.join(d, f) for f in damaged_files(d)] for d in dirs]}
    for side, d in zip("AB", dirs):
        common = files.read_common(d)
        info[side] = {"iteration": common.get("iteration"), "layout": common.get("layout")}
    keys = sorted(set(shapes[0]) | set(shapes[1]))
    if grads:
        keys = first_moment_keys(keys)
        if not keys:
            raise files.CheckpointError(f"{dirs[0]}: no optimizer first moments to compare (a model-only checkpoint?)")
    rows = []
    both = []
    for key in keys:
        sa, sb = shapes[0].get(key), shapes[1].get(key)
        if sa is None or sb is None:
            rows.append(Row(key, (sa or sb)[0], math.inf, math.inf, 0.0, f"only in {'A' if sb is None else 'B'}"))
        elif sa[0] != sb[0]:
            rows.append(Row(key, sa[0], math.inf, math.inf, 0.0, f"shape {sa[0]} in A, {sb[0]} in B"))
        else:
            both.append(key)
    for group in batches(both, shapes[0], batch_mib << 20):
        ta, tb = (offline.load_tensors(d, group, prefix="") for d in dirs)
        for key in group:
            x, y = ta.pop(key), tb.pop(key)
            note = "" if x.dtype == y.dtype else f"dtype {x.dtype} in A, {y.dtype} in B"
            rows.append(Row(key, tuple(x.shape), *stats(x, y), note))
    rows.sort(key=lambda r: (-(r.rel if not math.isnan(r.rel) else math.inf), r.key))
    return rows, info


def render(rows: list[Row], info: dict, top: int, rtol: float | None) -> str:
    lines = [f"A: {info['dirs'][0]} (iteration {info['A']['iteration']}, layout {info['A']['layout']})",
             f"B: {info['dirs'][1]} (iteration {info['B']['iteration']}, layout {info['B']['layout']})"]
    for side, damaged in zip("AB", info["damaged"]):
        for path in damaged:
            lines.append(f"WARNING: {side}: {path}: checksum differs from the one recorded at save time "
                         f"(damaged; its tensors are compared as they are)")
    width = max([len(r.key) for r in rows[:top]] + [6])
    lines.append(f"{'tensor':<{width}}  {'rel':>10}  {'max_abs':>10}  {'cosine':>12}  shape")
    for r in rows[:top]:
        over = "  <-- above --rtol" if rtol is not None and not r.rel <= rtol else ""
        lines.append(f"{r.key:<{width}}  {r.rel:10.3e}  {r.max_abs:10.3e}  {r.cosine:12.9f}  {list(r.shape)}"
                     + (f"  ({r.note})" if r.note else "") + over)
    if len(rows) > top:
        lines.append(f"... {len(rows) - top} more (--top)")
    worst = rows[0] if rows else None
    if worst is not None:
        lines.append(f"{len(rows)} tensors; worst: {worst.key} (relative difference {worst.rel:.3e})"
                     + ("" if rtol is None else f"; {sum(not r.rel <= rtol for r in rows)} above --rtol={rtol:g}"))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", help="checkpoint A: a save directory (its latest) or an iteration directory")
    parser.add_argument("b", help="checkpoint B, the reference (relative differences are over its norms)")
    parser.add_argument("--grads", action="store_true",
                        help="compare only the first moments (linear in the gradient after step 1)")
    parser.add_argument("--rtol", type=float, default=None,
                        help="exit 1 when a tensor's relative difference is above this (5e-6: the per-tensor "
                             "parity bound of step-1 gradients)")
    parser.add_argument("--top", type=int, default=20, help="rows to print (worst first); default 20")
    parser.add_argument("--batch-mib", type=int, default=512, help="MiB of tensors read at a time from each side")
    parser.add_argument("--json", action="store_true", help="print every row as one JSON object per line")
    args = parser.parse_args(argv)
    from megand.core.checkpointing import CheckpointError

    for name, value in (("--top", args.top), ("--batch-mib", args.batch_mib)):
        if value <= 0:
            print(f"compare_checkpoints: {name}={value} must be positive", file=sys.stderr)
            return 2
    try:
        rows, info = compare(args.a, args.b, grads=args.grads, batch_mib=args.batch_mib)
    except CheckpointError as e:
        print(f"compare_checkpoints: {e}", file=sys.stderr)
        return 2
    if args.json:
        for r in rows:
            print(json.dumps({**asdict(r), "shape": list(r.shape)}))
    else:
        print(render(rows, info, args.top, args.rtol))
    return 1 if args.rtol is not None and any(not r.rel <= args.rtol for r in rows) else 0
