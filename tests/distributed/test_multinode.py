"""Multi-node launch: two torchrun agents on this machine act as two "nodes" (c10d rendezvous, as in
examples/slurm.sbatch), 2 processes each, training tiny_gpt as tp=2 x dp=2. Node 1's ranks have
LOCAL_RANK 0/1 but global ranks 2/3, so anything confusing the two shows up here. The losses and grad
norms must equal, bit for bit, those of the same layout run by one agent with 4 processes."""

import os
import subprocess
import sys
import uuid

from megand.tools.spawn import free_port
from tests.harness import ranks_env, read_metrics, run_pretrain

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OVERRIDES = ["+experiment=tiny_gpt", "parallel.tp=2", "train.iters=4", "train.batch_checksum=true"]


def _two_agents(run_dir, timeout=600):
    port, job = free_port(), uuid.uuid4().hex[:8]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **ranks_env(4)}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=2",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={job}",
         os.path.join(ROOT, "pretrain_gpt.py"), f"run_dir={run_dir}", *OVERRIDES],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for node, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"agent {node} failed ({p.returncode}):\n{out[-5000:]}"
    return outputs


def test_two_nodes_equal_one_node(tmp_path):
    outputs = _two_agents(tmp_path / "two_nodes")
    assert sum("training done: 4 iterations" in out for out in outputs) == 1  # one logging rank in the job
    two_nodes = read_metrics(tmp_path / "two_nodes")
    run_pretrain(tmp_path / "one_node", OVERRIDES, nproc=4)
    one_node = read_metrics(tmp_path / "one_node")
    assert len(two_nodes) == len(one_node) == 4
    for a, b in zip(two_nodes, one_node):
        for key in ("loss", "grad_norm", "batch_checksum", "lr"):
            assert a[key] == b[key], (key, a, b)
