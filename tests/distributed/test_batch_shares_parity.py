"""Per-replica batch shares (``parallel.dp_microbatches``): data-parallel replicas that take different numbers
of micro-batches per step train exactly the one-process step of the whole global batch (fp32, the parity
tolerances of tests/harness.py), tensor by tensor too (AdamW's first moment after step 1 is ``(1-beta1) g``,
from the checkpoints, within 5e-6), at every sharding level (ZeRO-2/3 across replicas of different shares
through phantom micro-batches), with HSDP, MoE (the expert-parallel ranks inside a replica), document masks
and streams; a run resumes exactly from a share
layout to an even one and back."""

import pytest

from megand.core.checkpointing.offline import load_full_tensors
from tests.distributed.test_document_parity import short_docs  # noqa: F401 (a fixture)
from tests.distributed.test_pipeline_parity import val_losses
from tests.harness import assert_parity, read_metrics, run_pretrain

SMALL_BUCKETS = "optim.bucket_size=4000"  # several buckets: layer boundaries, shards that split parameters
ZERO1 = "optim.sharding=optim"
ZERO2 = "optim.sharding=optim_grads"
ZERO3 = "optim.sharding=optim_grads_params"
MOE = ("model=moe_tiny", "train.global_batch_size=4", "train.micro_batch_size=1")  # balancing losses per sample


def _first_moments(run_dir, nproc, overrides, experiment="tiny_llama", eval_iters=0):
    save = str(run_dir / "ckpt")
    run_pretrain(run_dir, [f"+experiment={experiment}", "train.iters=1", f"train.eval_iters={eval_iters}",
                           f"checkpoint.save={save}", *overrides], nproc=nproc)
    return {k: v for k, v in load_full_tensors(save, prefix="optim.").items() if k.endswith(".exp_avg")}


def assert_same_moments(run, ref):
    assert run and sorted(run) == sorted(ref)
    for key in ref:
        diff = (run[key] - ref[key]).norm() / ref[key].norm().clamp_min(1e-30)
        assert diff <= 5e-6, f"{key}: relative difference {diff:.2e}"


def test_shares_3_1_zero1_step_one_per_tensor(tmp_path):
    """dp=2 with shares [3,1] (global batch 8 = 4 micro-batches of 2), ZeRO-1 with overlap: every parameter's
    step-1 gradient equals the one-process one."""
    ref = _first_moments(tmp_path / "one", 1, ())
    run = _first_moments(tmp_path / "shares", 2, ("parallel.dp_microbatches=[3,1]", ZERO1, SMALL_BUCKETS,
                                                 "optim.overlap_grad_reduce=true", "optim.overlap_param_gather=true"))
    assert_same_moments(run, ref)


def test_shares_3_1_zero3_across_the_shard_group_step_one_per_tensor(tmp_path):
    """dp=2 with shares [3,1] and ZeRO-3 over both replicas: the one-micro-batch replica joins the two
    micro-batches it lacks as phantoms (their all-gathers and zero-contributing reduce-scatters), and every
    parameter's step-1 gradient equals the one-process one; so does the validation loss after it (the
    forward-only phantoms: all-gathers only)."""
    ref = _first_moments(tmp_path / "one", 1, (), eval_iters=1)
    run = _first_moments(tmp_path / "shares", 2, ("parallel.dp_microbatches=[3,1]", ZERO3, SMALL_BUCKETS,
                                                 "optim.overlap_grad_reduce=true"), eval_iters=1)
    assert_same_moments(run, ref)
    (val,), (val_ref,) = val_losses(tmp_path / "shares"), val_losses(tmp_path / "one")
    assert abs(val - val_ref) <= 1e-5 * abs(val_ref), (val, val_ref)


def test_shares_1_2_1_ten_steps(tmp_path, reference):
    """dp=3 with shares [1,2,1], plain data parallelism: ten steps and the validation loss."""
    run_pretrain(tmp_path, ["+experiment=tiny_llama", "parallel.dp_microbatches=[1,2,1]", SMALL_BUCKETS,
                            "optim.overlap_grad_reduce=true"], nproc=3)
    assert_parity(reference("tiny_llama"), read_metrics(tmp_path))


CASES = {  # name: (processes, experiment, reference overrides, run overrides)
    "1_2_1_zero1": (3, "tiny_llama", (), ("parallel.dp_microbatches=[1,2,1]", ZERO1, SMALL_BUCKETS)),
    # ZeRO-3 shards inside each replica (its cp ranks), replicated across the replicas: HSDP
    "3_1_cp2_hsdp_zero3": (4, "tiny_llama", (), ("parallel.dp_microbatches=[3,1]", "parallel.cp=2",
                                                 "parallel.dp_shard=2", ZERO3, SMALL_BUCKETS)),
    "3_3_1_1_zero1_hsdp_dp4": (4, "tiny_llama", ("train.global_batch_size=16",),
                               ("train.global_batch_size=16", "parallel.dp_microbatches=[3,3,1,1]",
                                "parallel.dp_shard=2", ZERO1, SMALL_BUCKETS)),
    "3_1_pp2": (4, "tiny_llama", (), ("parallel.dp_microbatches=[3,1]", "parallel.pp=2", ZERO1)),
    # ZeRO-2/3 sharded across replicas of different shares (pp=1): phantom micro-batches
    "1_2_1_zero3": (3, "tiny_llama", (), ("parallel.dp_microbatches=[1,2,1]", ZERO3, SMALL_BUCKETS)),
    "3_1_zero2": (2, "tiny_llama", (), ("parallel.dp_microbatches=[3,1]", ZERO2, SMALL_BUCKETS,
                                        "optim.overlap_grad_reduce=true")),
    "1_2_1_zero2": (3, "tiny_llama", (), ("parallel.dp_microbatches=[1,2,1]", ZERO2, SMALL_BUCKETS)),
    # HSDP whose shard groups each span a [3,1] pair of replicas; the pairs reduced over once per step
    "3_1_3_1_zero3_hsdp_dp4": (4, "tiny_llama", ("train.global_batch_size=16",),
                               ("train.global_batch_size=16", "parallel.dp_microbatches=[3,1,3,1]",
                                "parallel.dp_shard=2", ZERO3, SMALL_BUCKETS)),
    # each tensor-parallel rank's shard group spans the replicas; sequence-parallel norms reduced per step
    "3_1_tp2_sp_zero3": (4, "tiny_llama", (), ("parallel.dp_microbatches=[3,1]", "parallel.tp=2",
                                               "parallel.sequence_parallel=true", ZERO3, SMALL_BUCKETS)),
    # buckets kept from forward to backward, and gathered again for the recomputed forward
    "3_1_zero3_no_reshard_recompute": (2, "tiny_llama", (), ("parallel.dp_microbatches=[3,1]", ZERO3, SMALL_BUCKETS,
                                                             "optim.reshard_after_forward=false",
                                                             "train.recompute=full")),
    # the experts' shards over their expert-dp group, which spans both replicas (ep over each one's cp ranks)
    "moe_3_1_cp2_ep2_zero3": (4, "tiny_llama", MOE, (*MOE, "parallel.dp_microbatches=[3,1]", "parallel.cp=2",
                                                     "parallel.ep=2", ZERO3, SMALL_BUCKETS)),
    # ep inside a replica (over its cp ranks); micro-batches of one sample: the balancing losses of each are
    # the one-process run's
    "moe_3_1_cp2_ep2": (4, "tiny_llama", MOE, (*MOE, "parallel.dp_microbatches=[3,1]", "parallel.cp=2",
                                               "parallel.ep=2", ZERO1)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_shares_step_one_per_tensor(tmp_path, name):
    nproc, experiment, ref_overrides, overrides = CASES[name]
    ref = _first_moments(tmp_path / "one", 1, ref_overrides, experiment)
    assert_same_moments(_first_moments(tmp_path / name, nproc, overrides, experiment), ref)


@pytest.mark.slow
def test_moe_shares_ten_steps(tmp_path, reference):
    run_pretrain(tmp_path, ["+experiment=tiny_llama", *MOE, "parallel.dp_microbatches=[3,1]", "parallel.cp=2",
                            "parallel.ep=2", ZERO1], nproc=4)
    assert_parity(reference("tiny_llama", *MOE), read_metrics(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("sharding", [ZERO1, ZERO3])
def test_shares_with_document_masks(tmp_path, short_docs, sharding):
    """Ten steps and the validation loss; ZeRO-3 shards over the three replicas (phantom micro-batches)."""
    flags = ["data.reset_attention_mask=true", "data.reset_position_ids=true", "data.eod_mask_loss=true"]
    run_pretrain(tmp_path / "one", ["+experiment=tiny_llama", *short_docs, *flags], nproc=1)
    run_pretrain(tmp_path / "shares", ["+experiment=tiny_llama", *short_docs, *flags,
                                       "parallel.dp_microbatches=[1,2,1]", sharding], nproc=3)
    assert_parity(read_metrics(tmp_path / "one"), read_metrics(tmp_path / "shares"))
    (val,), (val_ref,) = val_losses(tmp_path / "shares"), val_losses(tmp_path / "one")
    assert abs(val - val_ref) <= 1e-4 * abs(val_ref), (val, val_ref)


@pytest.mark.slow
def test_resume_from_shares_to_even_and_back(tmp_path, reference):
    """Stopped at step 4 with shares [3,1], resumed at even dp=2 until step 7, then with shares [1,3]: the
    ten steps equal the one-process run's, and the data position carries over (the same samples)."""
    save = str(tmp_path / "ckpt")
    common = ["+experiment=tiny_llama", f"checkpoint.save={save}", f"checkpoint.load={save}", "train.eval_iters=0",
              "train.batch_checksum=true", ZERO1]
    run_pretrain(tmp_path / "run", [*common, "parallel.dp_microbatches=[3,1]", "train.exit_interval=4"], nproc=2)
    run_pretrain(tmp_path / "run", [*common, "train.exit_interval=7"], nproc=2)
    run_pretrain(tmp_path / "run", [*common, "parallel.dp_microbatches=[1,3]"], nproc=2)
    steps = {r["iter"]: r for r in read_metrics(tmp_path / "run") if "loss" in r}
    assert sorted(steps) == list(range(1, 11))
    ref = reference("tiny_llama")
    assert_parity(ref, [steps[i] for i in range(1, 11)])


@pytest.mark.slow
def test_stream_with_shares_reads_every_lane_once_and_resumes_at_an_even_split(tmp_path):
    """A stream at shares [3,1]: the same global batches (checksums) and losses as one process; stopped at
    step 6 and resumed at an even dp=2, the lanes' states carry over (the same batches again)."""
    import pathlib

    from tests.distributed.test_stream_runs import common
    from tests.unit.test_stream import write_corpus

    corpus = tmp_path / "corpus"
    write_corpus(pathlib.Path(corpus), 400)
    run_pretrain(tmp_path / "one", common(corpus, "data.workers=0"), nproc=1)
    save = str(tmp_path / "ckpt")
    args = common(corpus, "data.workers=0", f"checkpoint.save={save}", f"checkpoint.load={save}")
    run_pretrain(tmp_path / "shares", [*args, "parallel.dp_microbatches=[3,1]", "train.exit_interval=6"], nproc=2)
    run_pretrain(tmp_path / "shares", args, nproc=2)
    one = read_metrics(tmp_path / "one")
    steps = {r["iter"]: r for r in read_metrics(tmp_path / "shares")}
    run = [steps[r["iter"]] for r in one]
    assert [r["batch_checksum"] for r in run] == [r["batch_checksum"] for r in one]
    assert_parity(one, run)


@pytest.mark.slow
def test_fp8_zero3_shares_equal_the_fp8_one_process_run(tmp_path, reference):
    """Phantom micro-batches of ZeRO-3's FP8 gathers (the amax agreement, then the one-byte all-gather):
    shares [3,1] across the shard group, within the FP8 layouts' tolerance of the FP8 one-process run."""
    from tests.distributed.test_fp8_parity import FP8, assert_close_runs

    run_pretrain(tmp_path, ["+experiment=tiny_llama", *FP8, "parallel.dp_microbatches=[3,1]", ZERO3, SMALL_BUCKETS],
                 nproc=2)
    assert_close_runs(read_metrics(tmp_path), reference("tiny_llama", *FP8))
