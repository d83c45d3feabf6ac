"""Hang reports: what every rank was doing when the hang watchdog fired, and whom the others wait for.

The record is torch's flight recorder: a ring buffer in C++ of each process's last collective and
point-to-point operations (process group, op, sizes, dtypes, collective and p2p sequence numbers, whether it
completed), kept by gloo and NCCL alike at almost no cost, and switched on before the first process group is
made (:func:`enable_recorder`: ``TORCH_FR_BUFFER_SIZE``, for both backends; a value the user set is kept).
When the watchdog fires, each rank writes to ``${run_dir}/hang/``:

    rank_00003.json         iteration, phase, its process groups (name -> global ranks) and the recorder's entries
    rank_00003.stacks.txt   the Python stacks of all its threads (faulthandler)

then rank 0 waits a little for the others' files and writes ``summary.txt`` (also printed on stderr): for
each process group in which some rank waits, the collective it waits in (sequence number, op, sizes) and
the ranks that did not reach it; a rank that wrote no report is stopped or dead (or its run directory is
not shared with rank 0's: ``tools/hang_report.py`` summarises the files of all nodes gathered in one place).
"""

from __future__ import annotations

import faulthandler
import glob
import json
import os
import time

RECORDER_ENV = "TORCH_FR_BUFFER_SIZE"  # gloo and NCCL (NCCL's older TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated)
DIR = "hang"


def enable_recorder(entries: int) -> None:
    """Keep the last ``entries`` operations of this process (0: none). Call before any process group exists."""
    if entries > 0:
        os.environ.setdefault(RECORDER_ENV, str(entries))


def _recorder() -> dict | None:
    """The flight recorder's dump (None when this torch build has none, or it is off)."""
    import torch.distributed as dist

    try:
        from torch._C import _distributed_c10d as c10d

        if dist.get_backend() == "nccl" and hasattr(c10d, "_dump_nccl_trace_json"):
            return json.loads(c10d._dump_nccl_trace_json(True, False))
        return json.loads(c10d._dump_fr_trace_json(True, False))
    except Exception:  # noqa: BLE001 - a report without the record is still a report
        return None


def _groups() -> dict[str, list[int]]:
    """Every process group of this process: its name (as the recorder names it) -> its global ranks."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    out = {}
    for group, name in list(distributed_c10d._world.pg_names.items()):
        try:
            out[str(name)] = dist.get_process_group_ranks(group)
        except Exception:  # noqa: BLE001
            pass
    return out


def write_rank_report(run_dir: str, rank: int, world_size: int, iteration: int, phase: str, message: str) -> str:
    """This rank's files; returns the directory."""
    out = os.path.join(run_dir, DIR)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank_{rank:05d}.stacks.txt"), "w") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
    report = {"rank": rank, "world_size": world_size, "iteration": iteration, "phase": phase, "message": message,
              "time": time.time(), "groups": _groups(), "recorder": _recorder()}
    tmp = os.path.join(out, f".rank_{rank:05d}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.replace(tmp, os.path.join(out, f"rank_{rank:05d}.json"))  # a reader never sees half a report
    return out


def read_reports(directory: str) -> dict[int, dict]:
    reports = {}
    for path in sorted(glob.glob(os.path.join(directory, "rank_*.json"))):
        with open(path) as f:
            report = json.load(f)
        reports[int(report["rank"])] = report
    return reports


def _describe(entry: dict) -> str:
    op = entry.get("profiling_name", "?").split(":")[-1]
    return f"{op} of sizes {entry.get('input_sizes')} ({', '.join(entry.get('input_dtypes') or [])})"


def _pending(report: dict, name: str) -> tuple[int, dict | None, bool]:
    """(the last collective sequence number this rank entered in group ``name``, its entry, still waiting in it)."""
    record = report.get("recorder") or {}
    entries = [e for e in record.get("entries", []) if (e.get("process_group") or [None])[0] == name
               and not e.get("is_p2p")]
    last = max(entries, key=lambda e: e["collective_seq_id"], default=None)
    if last is None:
        return 0, None, False
    status = record.get("pg_status", {}).get(str(last.get("pg_id")))
    if status is not None:
        waiting = int(status.get("last_completed_collective", -1)) < last["collective_seq_id"]
    else:
        waiting = not last.get("retired")
    return last["collective_seq_id"], last, waiting


def summarize(reports: dict[int, dict], world_size: int | None = None) -> list[str]:
    """The summary's lines: who did not report, and per process group in which a rank waits, the collective
    and the ranks that did not reach it."""
    if world_size is None:
        world_size = max([r.get("world_size", 0) for r in reports.values()] + [0])
    missing = [r for r in range(world_size) if r not in reports]
    lines = [f"hang reports of {len(reports)} of {world_size} ranks"
             + (f"; no report from rank(s) {missing} (stopped, dead, or their run directory is elsewhere)"
                if missing else "")]
    for r, report in sorted(reports.items()):
        lines.append(f"rank {r}: iteration {report.get('iteration')}, phase '{report.get('phase')}'")
    groups = {}
    for report in reports.values():
        groups.update(report.get("groups", {}))
    named = set()
    for name, ranks in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        if len(ranks) < 2:
            continue
        seen = {r: _pending(reports[r], name) for r in ranks if r in reports}
        waiting = sorted(r for r, (_, _, w) in seen.items() if w)
        if not waiting:
            continue
        top = max(seen[r][0] for r in waiting)
        entry = seen[waiting[0]][1]
        late = [r for r in ranks if r not in seen or seen[r][0] < top]
        behind = [f"rank {r} (no report)" if r not in seen else
                  f"rank {r} ({'waits in' if r in waiting else 'last entered'} #{seen[r][0]}"
                  f"{': ' + _describe(seen[r][1]) if seen[r][1] else ''})" for r in late]
        # a late rank that itself waits, in an earlier collective that its peers have left (a ring whose
        # transfer from a stopped rank never came), is held up too: the others wait for the rest
        named.update([r for r in late if r not in waiting] or late)
        lines.append(f"process group {name} (ranks {ranks}): rank(s) {[r for r in waiting if seen[r][0] == top]} "
                     f"wait in collective #{top}, {_describe(entry)}; not reached by: "
                     + (", ".join(behind) if behind else "none (every member entered it: a slow or lost transfer)"))
    if named:
        lines.append(f"ranks the others wait for: {sorted(named)}")
    return lines


def write_summary(directory: str, world_size: int, wait_s: float) -> list[str]:
    """Rank 0: wait up to ``wait_s`` for every rank's report, then write and return the summary."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and len(glob.glob(os.path.join(directory, "rank_*.json"))) < world_size:
        time.sleep(0.5)
    lines = summarize(read_reports(directory), world_size)
    with open(os.path.join(directory, "summary.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines
