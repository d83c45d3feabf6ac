"""Hang reports: one rank of three stopped from outside (SIGSTOP); the others' watchdogs fire, every
running rank writes its stacks and its last operations (torch's flight recorder, gloo) to run_dir/hang/,
and rank 0's summary names the stopped rank and the collective the others wait in. tools/hang_report.py
prints the same summary from the files."""

import json
import os
import signal
import subprocess
import sys

from tests.distributed.torchrun_jobs import Job, metric_iters
from tests.harness import ROOT


def test_stopped_rank_is_named_in_the_hang_report(tmp_path):
    run_dir = str(tmp_path / "run")
    job = Job(run_dir, ["+experiment=tiny_gpt", "train.iters=500", "train.eval_iters=0", "train.global_batch_size=6",
                        "train.collective_timeout_s=6"], 3)
    job.wait_for(lambda: len(metric_iters(run_dir)) >= 3)
    stopped = job.ranks()[1]
    os.kill(stopped, signal.SIGSTOP)
    try:
        job.wait_for(lambda: "megand: hang report: ranks the others wait for" in job.output, timeout=120)
    finally:
        job.kill()
    hang = os.path.join(run_dir, "hang")
    assert sorted(os.listdir(hang)) == ["rank_00000.json", "rank_00000.stacks.txt", "rank_00002.json",
                                        "rank_00002.stacks.txt", "summary.txt"]
    with open(os.path.join(hang, "rank_00002.json")) as f:
        report = json.load(f)
    entries = report["recorder"]["entries"]
    assert entries and {"collective_seq_id", "input_sizes", "profiling_name", "process_group"} <= set(entries[-1])
    with open(os.path.join(hang, "rank_00000.stacks.txt")) as f:
        assert "Thread 0x" in f.read()
    with open(os.path.join(hang, "summary.txt")) as f:
        summary = f.read()
    assert "no report from rank(s) [1]" in summary
    assert "ranks the others wait for: [1]" in summary
    waits = [line for line in summary.splitlines() if line.startswith("process group") and "wait in collective #" in line]
    assert waits and all("rank 1 (no report)" in line for line in waits), summary
    world = [line for line in waits if "ranks [0, 1, 2]" in line]
    # ranks 0 and 2 wait in one collective; or rank 1 stopped mid-ring after one of them had its share, and
    # that one went on into the next collective while the other still waits in this one
    assert world and all("rank(s) [0, 2] wait" in line or "waits in #" in line for line in world), summary

    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "hang_report.py"), run_dir],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert summary.strip() in proc.stdout and "collective #" in proc.stdout
