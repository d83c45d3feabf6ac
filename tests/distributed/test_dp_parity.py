"""Parity (tests/harness.py tolerances) of the data-parallel engine and the distributed optimizer (fp32, torchrun)."""

import pytest

from tests.harness import assert_parity, read_metrics, run_pretrain

SMALL_BUCKETS = "optim.bucket_size=4000"  # several buckets: layer boundaries, shards that split parameters


@pytest.fixture
def llama_reference(reference):
    return reference("tiny_llama")


def _run(tmp_path, name, overrides, nproc, experiment="tiny_llama"):
    run_dir = tmp_path / name
    run_pretrain(run_dir, [f"+experiment={experiment}", *overrides], nproc=nproc)
    return read_metrics(run_dir)


@pytest.mark.slow
def test_dp2_distributed_optimizer_overlap_on_and_off(tmp_path, llama_reference):
    base = ["optim.sharding=optim", SMALL_BUCKETS]
    off = _run(tmp_path, "off", base, 2)
    on = _run(tmp_path, "on", base + ["optim.overlap_grad_reduce=true", "optim.overlap_param_gather=true"], 2)
    assert_parity(llama_reference, off)
    assert_parity(llama_reference, on)
    assert [r["loss"] for r in on] == [r["loss"] for r in off]
    assert [r["grad_norm"] for r in on] == [r["grad_norm"] for r in off]


@pytest.mark.slow  # dp4 under ZeRO-1 runs in the default suite in test_sharding_parity and test_checkpoint_memory
def test_dp4_distributed_optimizer(tmp_path, llama_reference):
    run = _run(tmp_path, "dp4", ["optim.sharding=optim", "optim.overlap_grad_reduce=true",
                                 "optim.overlap_param_gather=true", SMALL_BUCKETS], 4)
    assert_parity(llama_reference, run)


@pytest.mark.slow  # tp2 x dp2 with sp runs in the default suite in test_tensor_parallel_parity
def test_dp2_tp2_sequence_parallel_distributed_optimizer(tmp_path, llama_reference):
    run = _run(tmp_path, "dp2tp2", ["parallel.tp=2", "parallel.sequence_parallel=true", "optim.sharding=optim",
                                    "optim.overlap_grad_reduce=true", SMALL_BUCKETS], 4)
    assert_parity(llama_reference, run)


def test_gpt_tied_embeddings_dp2_overlapped_all_reduce(tmp_path, reference):
    """GPT style (tied embeddings, learned positions, biases) with the plain optimizer and overlap."""
    run = _run(tmp_path, "gpt_dp2", ["optim.overlap_grad_reduce=true", SMALL_BUCKETS], 2, experiment="tiny_gpt")
    assert_parity(reference("tiny_gpt"), run)


def test_pp2_dp2_distributed_optimizer_tied_embeddings(tmp_path, reference):
    """The distributed optimizer under pipelining: tied embedding copies on two stages, shards over dp."""
    run = _run(tmp_path, "gpt_pp2_dp2", ["parallel.pp=2", "optim.sharding=optim", "optim.overlap_grad_reduce=true",
                                         SMALL_BUCKETS], 4, experiment="tiny_gpt")
    assert_parity(reference("tiny_gpt"), run)
