"""Two-tier checkpoints: two "nodes" (two torchrun agents, each with its own node-local directory) at dp=4
save to the local tier every iteration and to the shared tier every 4. One agent is SIGKILLed and its local
directory deleted, and every file of the shared tier's checkpoints is overwritten with zeros (from outside:
reading any of them would fail). The restarted job restores from the local tier, node 1's ranks from their
replicas on node 0, reading nothing of the shared tier but its `latest` pointer (watched from outside the
job with inotify), and ends with the losses and the final tensors of an uninterrupted run."""

import json
import os
import shutil

import pytest

from megand.tools.compare_checkpoints import compare
from tests.distributed.torchrun_jobs import Job
from tests.file_reads import FileReads
from tests.harness import read_metrics, run_pretrain

ITERS = 24
COMMON = ["+experiment=tiny_gpt", "train.eval_iters=0"]
LOCAL = "checkpoint.local_dir=${oc.env:MEGAND_TEST_LOCAL_DIR}"


def tiered(save, *extra, iters=ITERS):
    return [*COMMON, f"train.iters={iters}", f"checkpoint.save={save}", f"checkpoint.load={save}", "checkpoint.interval=4", LOCAL,
            "checkpoint.local_interval=1", *extra]


def local_iterations(local_dir) -> list[int]:
    """The local iterations whose four files (two ranks' own, two replicas) a node's directory holds."""
    try:
        return [int(n[5:]) for n in os.listdir(local_dir) if n.startswith("iter_")
                and len([f for f in os.listdir(os.path.join(local_dir, n)) if f.endswith(".pt")]) == 4]
    except FileNotFoundError:
        return []


def published(save) -> int:
    try:
        with open(os.path.join(save, "latest")) as f:
            return int(f.read())
    except (FileNotFoundError, ValueError):
        return 0


def checkpoint_bytes(save, iteration) -> int:
    top = os.path.join(save, f"iter_{iteration:07d}")
    return sum(os.path.getsize(os.path.join(root, n)) for root, _, names in os.walk(top) for n in names)


def events(run_dir, name) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r.get("event") == name]


def final_losses(run_dir) -> dict[int, float]:
    return {r["iter"]: r["loss"] for r in read_metrics(run_dir)}


def zero_shared_checkpoints(save) -> None:
    """Overwrite every file of every checkpoint of the shared tier with zeros: the tensor data, DCP's metadata,
    the RNG states, the scalars and model section (`common.pt`), the config and the manifest. Kept: `latest`."""
    for name in os.listdir(save):
        for root, _, names in os.walk(os.path.join(save, name)):
            for n in names:
                path = os.path.join(root, n)
                size = os.path.getsize(path)
                with open(path, "r+b") as f:
                    f.write(bytes(size))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    run_pretrain(str(root / "run"), [*COMMON, f"train.iters={ITERS}", f"checkpoint.save={root / 'ckpt'}"], nproc=4)
    return final_losses(str(root / "run")), str(root / "ckpt")


def two_nodes(run_dir, save, locals_, *extra):
    return Job(run_dir, tiered(save, *extra), 2, nnodes=2,
               node_env=[{"MEGAND_TEST_LOCAL_DIR": d} for d in locals_])


def assert_same_final_tensors(save, reference_save):
    rows, _ = compare(save, reference_save)
    assert rows and all(r.max_abs == 0 for r in rows), [r for r in rows if r.max_abs != 0][:3]


def test_lost_node_restores_from_its_peer_without_the_shared_tier(tmp_path, uninterrupted):
    losses, reference_save = uninterrupted
    run_dir, save = str(tmp_path / "run"), str(tmp_path / "ckpt")
    locals_ = [str(tmp_path / "local0"), str(tmp_path / "local1")]
    job = two_nodes(run_dir, save, locals_)
    job.wait_for(lambda: published(save) >= 4 and max(local_iterations(locals_[0]), default=0) >= 6)
    job.kill(nodes=[1])  # node 1's agent and its workers, SIGKILL
    assert job.wait() != 0  # node 0's ranks lose their peers
    shutil.rmtree(locals_[1])  # node 1 and its disk are gone
    newest = max(local_iterations(locals_[0]))
    assert newest > published(save)
    zero_shared_checkpoints(save)

    watch = FileReads(save)  # the shared tier's files as they are now; the job's own new saves are not counted
    job = two_nodes(run_dir, save, locals_)
    assert job.wait() == 0, job.output[-4000:]
    read = watch.files()
    latest = os.path.join(save, "latest")
    assert read <= {latest}, sorted(read - {latest})  # nothing of the shared tier but its pointer
    print(f"shared tier read by the restart: {sorted(read)}, at most {os.path.getsize(latest)} bytes")
    (restored,) = events(run_dir, "checkpoint_restored")
    assert restored["tier"] == "local" and restored["iter"] == newest, restored
    assert restored["from_replica"] == [2, 3]  # node 1's ranks, from node 0's replicas
    assert restored["bytes_shared"] <= 8 and restored["bytes_local"] > 0  # the shared tier: only `latest`
    # the state replicated over dp is saved (and read) once, not once per dp rank: no more than a shared checkpoint
    assert restored["bytes_local"] <= checkpoint_bytes(save, published(save)), restored
    assert final_losses(run_dir) == losses  # bit for bit, every iteration
    assert_same_final_tensors(save, reference_save)
    assert local_iterations(locals_[1]) == [ITERS]  # node 1's disk holds the newest state again


@pytest.mark.slow
def test_local_tier_lost_or_of_another_layout_falls_back_to_the_shared_tier(tmp_path, uninterrupted):
    losses, reference_save = uninterrupted
    run_dir, save = str(tmp_path / "run"), str(tmp_path / "ckpt")
    locals_ = [str(tmp_path / "local0"), str(tmp_path / "local1")]
    job = two_nodes(run_dir, save, locals_, "train.exit_interval=6")
    assert job.wait() == 0, job.output[-4000:]
    # another layout: the local tier (iteration 6) is passed over with one line and the shared one loaded (the
    # stop saved iteration 6 there too); train.iters=6: nothing trained, nothing saved
    other = run_pretrain(str(tmp_path / "other"), tiered(save, "parallel.tp=2", iters=6),
                         nproc=4, extra_env={"MEGAND_TEST_LOCAL_DIR": locals_[0]})
    assert "the local tier restores only at the same layout; loading the shared tier" in other.stdout
    (restored,) = events(str(tmp_path / "other"), "checkpoint_restored")
    assert restored["tier"] == "shared" and restored["iter"] == 6 and restored["bytes_local"] == 0, restored
    # both nodes' local dirs lost: the shared tier
    for d in locals_:
        shutil.rmtree(d)
    job = two_nodes(run_dir, save, locals_)
    assert job.wait() == 0, job.output[-4000:]
    restored = events(run_dir, "checkpoint_restored")[-1]
    assert restored["tier"] == "shared" and restored["bytes_shared"] > 0, restored
    assert final_losses(run_dir) == losses
    assert_same_final_tensors(save, reference_save)


@pytest.mark.slow
def test_one_node_restores_its_own_local_tier(tmp_path, uninterrupted):
    """One node: no replica (said in one line); the tier still serves a restart of the processes."""
    losses, _ = uninterrupted
    run_dir, save, local = str(tmp_path / "run"), str(tmp_path / "ckpt"), str(tmp_path / "local")
    env = {"MEGAND_TEST_LOCAL_DIR": local}
    first = run_pretrain(run_dir, tiered(save, "train.exit_interval=6"), nproc=4,
                         extra_env=env)
    assert "no peer node to replicate to" in first.stdout
    shutil.rmtree(os.path.join(save, "iter_0000006"))  # the shared tier holds iteration 4 only
    with open(os.path.join(save, "latest"), "w") as f:
        f.write("4\n")
    run_pretrain(run_dir, tiered(save), nproc=4, extra_env=env)
    restored = events(run_dir, "checkpoint_restored")[-1]
    assert restored["tier"] == "local" and restored["iter"] == 6 and restored["from_replica"] == [], restored
    assert final_losses(run_dir) == losses


def corrupt(path) -> None:
    """Flip the last byte of a file (its payload's, past the header), from outside the job."""
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))


@pytest.mark.slow
def test_corrupted_local_copy_falls_back_to_its_replica_then_to_the_shared_tier(tmp_path, uninterrupted):
    losses, _ = uninterrupted
    run_dir, save = str(tmp_path / "run"), str(tmp_path / "ckpt")
    locals_ = [str(tmp_path / "local0"), str(tmp_path / "local1")]
    job = two_nodes(run_dir, save, locals_, "train.exit_interval=6")
    assert job.wait() == 0, job.output[-4000:]
    # rank 0's own file damaged: its replica on node 1 is read instead, with a line saying so
    corrupt(os.path.join(locals_[0], "iter_0000006", "rank_00000.pt"))
    job = two_nodes(run_dir, save, locals_, "train.exit_interval=8")
    assert job.wait() == 0, job.output[-4000:]
    assert "rank_00000.pt on node 0: corrupted" in job.output and "reading its replica instead" in job.output
    restored = events(run_dir, "checkpoint_restored")[-1]
    assert restored["tier"] == "local" and restored["iter"] == 6 and restored["from_replica"] == [0], restored
    # both copies of rank 1's state damaged: the shared tier (iteration 8, saved at the stop) is loaded
    corrupt(os.path.join(locals_[0], "iter_0000008", "rank_00001.pt"))
    corrupt(os.path.join(locals_[1], "iter_0000008", "replica_00001.pt"))
    job = two_nodes(run_dir, save, locals_, "train.exit_interval=10")
    assert job.wait() == 0, job.output[-4000:]
    assert "no other copy of it survives: local iteration 8 cannot be restored; loading the shared tier" in job.output
    restored = events(run_dir, "checkpoint_restored")[-1]
    assert restored["tier"] == "shared" and restored["iter"] == 8, restored
    assert final_losses(run_dir) == {i: losses[i] for i in range(1, 11)}  # bit for bit, every iteration
