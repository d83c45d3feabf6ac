"""The planner's own wall time on the searches that used to be slow (issue figures: minutes each).

    python benchmarks/plan_speed.py [--cases two_types,five_nodes,replicas,bloom,mixed_widths,replica_speeds]
        [--repo DIR] [--time-budget S]

Each case runs ``tools/plan.py`` as a user would (a fresh process: imports included) and prints its wall
time, its CPU seconds, the best plan's predicted tokens/s and the load average. ``--repo DIR`` runs another checkout's
``tools/plan.py`` on the same cases (e.g. the commit before a speed-up, for before/after figures; the
cluster files are written here, so any checkout reads them). ``--time-budget S`` passes the planner's budget.

Cases:
  two_types   Llama 70B, 8k tokens, batch 512 on examples/cluster_two_types.yaml (2 H200 + 2 H100 nodes)
  five_nodes  the same model on five nodes of two types (3 H200 + 2 H100)
  replicas    Llama 8B, 4k tokens, batch 256 on 2 H100 + 2 A100 nodes: whole replicas per node, of two
              speeds (the best plan gives the H100 replicas more micro-batches, parallel.dp_microbatches)
  bloom       BLOOM-176B's shape (GPT, 70 layers, hidden 14336, 112 heads, vocab 250880, 2k tokens, batch
              2048) on 48 DGX A100 nodes (384 GPUs)
  mixed_widths    Llama 70B, 4k tokens, batch 32 on examples/cluster_mixed_widths.yaml (1 H200 + 1 H100 node:
                  the best plan runs each group's stages at its own tp)
  replica_speeds  Llama 1B, 2k tokens, batch 128 on examples/cluster_replica_speeds.yaml (1 H100 + 1 A100 node:
                  one-GPU replicas, more micro-batches on the H100s)
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plan_runs import ROOT, load_average  # noqa: E402

LLAMA_70B = ["model=llama_70b", "model.seq_length=8192", "train.global_batch_size=512"]
BLOOM = ["model=gpt2_125m", "model.num_layers=70", "model.hidden_size=14336", "model.ffn_hidden_size=57344",
         "model.num_attention_heads=112", "model.vocab_size=250880", "model.seq_length=2048",
         "train.global_batch_size=2048"]


def _group(name, nodes, device):
    return f"  - name: {name}\n    nodes: {nodes}\n    devices_per_node: 8\n    device: {device}\n"


CLUSTERS = {
    "five_nodes": "groups:\n" + _group("h200", 3, "h200") + _group("h100", 2, "h100"),
    "replicas": "groups:\n" + _group("h100", 2, "h100") + _group("a100", 2, "a100"),
    "bloom": "groups:\n" + _group("a100", 48, "a100"),
}
CASES = {
    "two_types": (LLAMA_70B, os.path.join(ROOT, "examples", "cluster_two_types.yaml")),
    "five_nodes": (LLAMA_70B, "five_nodes"),
    "replicas": (["model=llama_8b", "model.seq_length=4096", "train.global_batch_size=256"], "replicas"),
    "bloom": (BLOOM, "bloom"),
    "mixed_widths": (["model=llama_70b", "model.seq_length=4096", "train.global_batch_size=32"],
                     os.path.join(ROOT, "examples", "cluster_mixed_widths.yaml")),
    "replica_speeds": (["model=llama_1b", "model.seq_length=2048", "train.global_batch_size=128"],
                       os.path.join(ROOT, "examples", "cluster_replica_speeds.yaml")),
}


def run_case(repo: str, overrides, cluster: str, budget, timeout: float) -> dict:
    args = [sys.executable, os.path.join(repo, "tools", "plan.py"), *overrides, "--cluster", cluster, "--top", "3"]
    if budget is not None:
        args += ["--time-budget", str(budget)]
    env = {**os.environ, "PYTHONPATH": repo, "OMP_NUM_THREADS": "1"}
    t0, cpu0 = time.monotonic(), _children_cpu()
    try:
        out = subprocess.run(args, capture_output=True, text=True, env=env, cwd=repo, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"wall_s": time.monotonic() - t0, "cpu_s": _children_cpu() - cpu0, "timed_out": True, "stdout": "",
                "rc": None}
    return {"wall_s": time.monotonic() - t0, "cpu_s": _children_cpu() - cpu0, "timed_out": False,
            "stdout": out.stdout, "stderr": out.stderr, "rc": out.returncode}


def _children_cpu() -> float:
    """User + system CPU seconds of the finished child processes (on a loaded machine the wall time also
    counts the time others held the cores; the CPU seconds do not)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def summary(stdout: str) -> str:
    """The best plan's row (tokens/s and layout) and any replica-shares / cut lines."""
    lines = stdout.splitlines()
    rows = [ln for ln in lines if re.match(r"^\s+1\s", ln)]
    shares = [ln.strip() for ln in lines if "replica shares" in ln][:1] if rows and "replicas on" in rows[0] else []
    cut = [ln.strip() for ln in lines if "was cut" in ln]
    return " | ".join([" ".join(rows[0].split()) if rows else "(no table)"] + shares + cut)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--repo", default=ROOT, help="the checkout whose tools/plan.py runs (default: this one)")
    p.add_argument("--time-budget", type=float, default=None)
    p.add_argument("--timeout", type=float, default=1800, help="give up on one case after this many seconds")
    args = p.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="megand-plan-speed-")
    for name in args.cases.split(","):
        overrides, cluster = CASES[name]
        if cluster in CLUSTERS:
            path = os.path.join(workdir, f"{cluster}.yaml")
            with open(path, "w") as f:
                f.write(CLUSTERS[cluster])
            cluster = path
        before = load_average()
        r = run_case(os.path.abspath(args.repo), overrides, cluster, args.time_budget, args.timeout)
        state = "TIMED OUT" if r["timed_out"] else f"rc {r['rc']}"
        print(f"{name}: {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} s CPU ({state}; load average {before} -> {load_average()}): "
              f"{summary(r['stdout'])}", flush=True)
        if r["rc"] not in (0, None):
            print("  " + (r.get("stderr") or "").strip().splitlines()[-1:][0] if r.get("stderr") else "", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
