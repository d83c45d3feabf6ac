"""Read the hang reports a run's ranks wrote when the watchdog fired (``${run_dir}/hang/``).

    python tools/hang_report.py RUN_DIR [--world-size N] [--ops 5] [--stacks]

Prints the summary (which ranks the others wait for, and in which collective), then each reporting rank's
last ``--ops`` operations from torch's flight recorder (process group, op, sizes, sequence numbers, state),
and with ``--stacks`` the Python stacks of its threads. RUN_DIR may also be a directory where the ``hang/``
files of several nodes were gathered.
"""

import argparse
import os
import sys


def _op_line(entry: dict) -> str:
    seq = f"p2p #{entry.get('p2p_seq_id')}" if entry.get("is_p2p") else f"collective #{entry.get('collective_seq_id')}"
    group = (entry.get("process_group") or ["?"])[0]
    done = "completed" if entry.get("retired") else "NOT completed"
    return (f"    group {group} {seq}: {entry.get('profiling_name')} in {entry.get('input_sizes')} "
            f"out {entry.get('output_sizes')} {', '.join(entry.get('input_dtypes') or [])} ({done})")


def main(argv=None) -> int:
    from megand.training.hang_report import DIR, read_reports, summarize

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="the run directory (its hang/ subdirectory is read), or the hang/ directory")
    parser.add_argument("--world-size", type=int, default=None, help="ranks of the job (default: from the reports)")
    parser.add_argument("--ops", type=int, default=5, help="last operations shown per rank (default 5)")
    parser.add_argument("--stacks", action="store_true", help="also print each rank's Python stacks")
    args = parser.parse_args(argv)
    directory = args.run_dir if os.path.basename(os.path.normpath(args.run_dir)) == DIR else os.path.join(args.run_dir, DIR)
    reports = read_reports(directory) if os.path.isdir(directory) else {}
    if not reports:
        print(f"hang_report: no hang reports in {directory}", file=sys.stderr)
        return 2
    print("\n".join(summarize(reports, args.world_size)))
    for rank, report in sorted(reports.items()):
        entries = (report.get("recorder") or {}).get("entries") or []
        print(f"rank {rank}: {report.get('message')}")
        if not entries:
            print("    (no operations recorded: train.hang_report_ops=0, or this torch build has no flight recorder)")
        for entry in entries[-args.ops:]:
            print(_op_line(entry))
        if args.stacks:
            with open(os.path.join(directory, f"rank_{rank:05d}.stacks.txt")) as f:
                print(f.read())
    return 0
