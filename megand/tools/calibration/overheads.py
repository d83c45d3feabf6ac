"""Fixed framework costs from real training steps: tiny ``pretrain_gpt.py`` runs of several layer and
micro-batch counts, one process each, whose step times beyond the modelled compute are fitted by
megand.tools.calibration.fit.fit_overheads."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# the tiny GPT of the parity tests with one sample per micro-batch: framework costs dominate its steps
BASE_OVERRIDES = ("+experiment=tiny_gpt", "train.micro_batch_size=1", "train.eval_iters=0", "optim.warmup_iters=1")
# (layers, micro-batches per step): both factors at two levels and a centre point
DESIGN = ((1, 1), (6, 1), (1, 4), (6, 4), (3, 2))
ITERS, WARMUP_ITERS = 30, 5  # steps per run (a step is milliseconds: the start-up dominates); the first ones are left out

# a launcher's variables would make the child join the calibration's process group
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "ROLE_RANK",
               "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_USE_AGENT_STORE")


def run_overrides(layers: int, microbatches: int, extra=()) -> list[str]:
    return [*BASE_OVERRIDES, f"model.num_layers={layers}", f"train.global_batch_size={microbatches}",
            f"train.iters={ITERS}", *extra]


def steady_step_seconds(metrics_path: str) -> float:
    """Median ``iter_time_ms`` of the steps after the first ``WARMUP_ITERS``, in seconds."""
    with open(metrics_path) as f:
        rows = [r for r in map(json.loads, f) if "iter_time_ms" in r]
    steady = [r["iter_time_ms"] for r in rows if r["iter"] > WARMUP_ITERS]
    if not steady:
        raise RuntimeError(f"{metrics_path}: no steady steps among {len(rows)} logged")
    return statistics.median(steady) / 1e3


def device_env(device) -> dict:
    """The environment that gives a child process this rank's device as its only (first) one: without the
    launcher's LOCAL_RANK every child would pick GPU 0."""
    if device.type != "cuda":
        return {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(device.index + 1)]
    return {"CUDA_VISIBLE_DEVICES": ids[device.index]}


def one_process_step_seconds(overrides, workdir: str, device) -> float:
    """Steady step time of a world-of-one ``pretrain_gpt.py`` run on this rank's device (and CPU affinity)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **device_env(device))
    run_dir = tempfile.mkdtemp(dir=workdir)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), f"run_dir={run_dir}", *overrides],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise RuntimeError(f"overhead run {' '.join(overrides)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return steady_step_seconds(os.path.join(run_dir, "metrics.jsonl"))
