"""Elastic continuation under torchrun's elastic rendezvous (``--nnodes=1:2``, c10d): two agents of 2 workers
each ("nodes") train tiny_llama at dp=4; one agent is killed from outside (SIGKILL on its process group: a
lost node), the other's workers restart alone at dp=2 from the last checkpoint (two micro-batches per
replica instead of one: the same global batch); the agent is started again and the job grows back to dp=4
from the checkpoint written at dp=2. Every logged step equals the uninterrupted dp=4 run's: bit for bit
before the first restart (the same layout), within the layout tolerance after it (dp changes only fp32
summation order), with the same samples (batch checksum) and learning rates."""

import re
import socket
import uuid

import pytest

from megand.tools.spawn import free_port
from tests.distributed.torchrun_jobs import Job
from tests.harness import read_metrics, run_pretrain

ITERS, INTERVAL = 300, 5
COMMON = ["+experiment=tiny_llama", "train.eval_iters=0", f"train.iters={ITERS}", "train.batch_checksum=true"]
LOSS_RTOL = 1e-4  # the correctness protocol's per-step loss bound across layouts


def listening(endpoint) -> bool:
    host, port = endpoint.split(":")
    try:
        socket.create_connection((host, int(port)), timeout=0.5).close()
        return True
    except OSError:
        return False


def loaded(job) -> list[int]:
    return [int(n) for n in re.findall(r"loaded checkpoint \S+ at iteration (\d+)", job.output)]


def saved(job) -> list[int]:
    return [int(n) for n in re.findall(r"saved checkpoint at iteration (\d+)", job.output)]


class ElasticNode(Job):
    """One torchrun agent of an elastic job (tools/launch.py: torchrun's agent, which sets the elastic
    rendezvous up as megand needs it)."""

    def __init__(self, run_dir, overrides, endpoint, run_id):
        launcher = ("tools/launch.py", "--nnodes=1:2", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                    f"--rdzv-id={run_id}", "--max-restarts=3", "--monitor-interval=0.5",
                    "--rdzv-conf=last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3")
        super().__init__(run_dir, overrides, 2, launcher=launcher, rendezvous=[])


@pytest.mark.slow  # ~3 min on two loaded cores: three rendezvous rounds and 300 steps, plus the reference
def test_two_nodes_one_node_two_nodes_continue_the_run(tmp_path):
    run_dir, save = str(tmp_path / "run"), str(tmp_path / "ckpt")
    overrides = [*COMMON, f"checkpoint.save={save}", f"checkpoint.load={save}", f"checkpoint.interval={INTERVAL}"]
    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    a = ElasticNode(run_dir, overrides, endpoint, run_id)
    # the first agent hosts the c10d rendezvous store; it must outlive the job (a lost host ends the rendezvous,
    # as torch documents): the node lost below is the other one
    a.wait_for(lambda: listening(endpoint))
    b = ElasticNode(run_dir, overrides, endpoint, run_id)
    a.wait_for(lambda: len(b.ranks()) == 2)  # both nodes' workers run: world size 4, dp=4
    done = len(saved(a) + saved(b))
    a.wait_for(lambda: len(saved(a) + saved(b)) >= done + 2)
    b.kill()  # a node lost: its agent and workers
    # one node, dp=2: resumed, then two checkpoints of its own
    a.wait_for(lambda: loaded(a) and max(saved(a)) > loaded(a)[0] + INTERVAL)
    c = ElasticNode(run_dir, overrides, endpoint, run_id)  # the node is back
    assert a.wait() == 0 and c.wait() == 0, a.output[-4000:] + c.output[-4000:]
    output = a.output + c.output
    restarts = [int(n) for n in re.findall(r"loaded checkpoint \S+ at iteration (\d+)", output)]
    widths = re.findall(r"world size (\d+) -> (\d+), dp (\d+) -> (\d+), micro-batches per replica (\d+) -> (\d+)",
                        output)
    assert widths == [("4", "2", "4", "2", "1", "2"), ("2", "4", "2", "4", "2", "1")], output[-4000:]
    assert len(restarts) == 2 and restarts[0] < restarts[1] < ITERS

    reference_dir = str(tmp_path / "reference")
    run_pretrain(reference_dir, COMMON, nproc=4)
    reference = {r["iter"]: r for r in read_metrics(reference_dir)}
    final = {r["iter"]: r for r in read_metrics(run_dir)}  # the last time each iteration was computed
    assert sorted(final) == list(range(1, ITERS + 1))
    worst = 0.0
    for it, r in final.items():
        ref = reference[it]
        assert r["batch_checksum"] == ref["batch_checksum"] and r["lr"] == ref["lr"], (it, r, ref)
        assert r["consumed_samples"] == ref["consumed_samples"]
        if it <= restarts[0]:  # before the first restart: the same layout, bit for bit
            assert r["loss"] == ref["loss"] and r["grad_norm"] == ref["grad_norm"], (it, r, ref)
        rel = abs(r["loss"] - ref["loss"]) / abs(ref["loss"])
        worst = max(worst, rel)
        assert rel <= LOSS_RTOL, (it, r["loss"], ref["loss"])
    print(f"elastic 4 -> 2 -> 4 ranks: restarts from iterations {restarts}; max relative loss difference "
          f"to the uninterrupted run {worst:.3e} over {ITERS} steps")
