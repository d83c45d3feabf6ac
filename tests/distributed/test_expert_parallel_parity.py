"""Expert parallelism equals the one-process run (fp32, dropless, tests/harness.py tolerances).

The balancing losses are computed over each micro-batch's global token set (every dp rank's micro-batch of
that index), so the one-process reference runs micro-batches of dp x micro_batch_size samples: a dp rank
splits its contiguous slice of the global batch into micro-batches by stride, so the step's micro-batch j
holds the reference's j-th samples. Most cases run ONE micro-batch per rank and the reference the whole
global batch as one micro-batch. Aux and z losses are on (moe_tiny's coefficients), so their gradients are
compared too.
"""

import pytest

from tests.harness import assert_parity, read_metrics, run_pretrain

MOE = ["model=moe_tiny", "train.global_batch_size=4"]  # on +experiment=tiny_llama (10 steps, fp32)
ONE_MICROBATCH = "train.micro_batch_size=4"  # the reference: the global batch as one micro-batch
# the reference of dp=2 ranks running 2 micro-batches of 2 (a global batch of 8)
TWO_MICROBATCHES_OF_4 = ("train.global_batch_size=8", "train.micro_batch_size=4")


def _run(run_dir, overrides, nproc):
    run_pretrain(run_dir, ["+experiment=tiny_llama", *MOE, *overrides], nproc=nproc)
    return read_metrics(run_dir)


def _check(tmp_path, reference, overrides, nproc, model=(), reference_batch=(ONE_MICROBATCH,)):
    ref = reference("tiny_llama", *MOE, *model, *reference_batch)
    run = _run(tmp_path / "run", [*model, *overrides], nproc)
    assert_parity(ref, run)
    assert all(r["expert_load_max_over_mean"] >= 1.0 for r in run)
    for a, b in zip(ref, run):  # the balancing statistics are global: every layout logs the reference's
        assert abs(a["aux_loss"] - b["aux_loss"]) <= 1e-5 * abs(a["aux_loss"]), (a["aux_loss"], b["aux_loss"])
        assert a["expert_load_max_over_mean"] == b["expert_load_max_over_mean"]
    return run


def test_ep2_dp4(tmp_path, reference):
    """Experts split over 2 ranks and reduced over their expert-dp group of 2; dense weights over 4."""
    _check(tmp_path, reference, ["train.micro_batch_size=1", "parallel.ep=2"], 4)


@pytest.mark.slow
def test_ep2_tp2_sequence_parallel(tmp_path, reference):
    _check(tmp_path, reference, ["train.micro_batch_size=2", "parallel.ep=2", "parallel.tp=2",
                                 "parallel.sequence_parallel=true"], 4)


@pytest.mark.slow
def test_ep2_tp2_without_sequence_parallel(tmp_path, reference):
    """Experts split over tp, tokens replicated over tp: the exchange runs between ranks of one tp rank."""
    _check(tmp_path, reference, ["train.micro_batch_size=2", "parallel.ep=2", "parallel.tp=2"], 4)


@pytest.mark.slow
def test_ep4(tmp_path, reference):
    _check(tmp_path, reference, ["train.micro_batch_size=1", "parallel.ep=4"], 4)


@pytest.mark.slow
@pytest.mark.parametrize("sp", [True, False])
def test_ep2_tp2_whole_experts_per_tp_rank(tmp_path, reference, sp):
    """etp=1: the ep group is the tp peers (Megatron's expert grid), each routing its sequence shard
    (without sequence parallelism: its share of the replicated tokens, gathered again after)."""
    _check(tmp_path, reference, ["train.micro_batch_size=2", "parallel.ep=2", "parallel.tp=2", "parallel.etp=1",
                                 f"parallel.sequence_parallel={sp}"], 4)


@pytest.mark.slow
def test_ep2_pp2(tmp_path, reference):
    _check(tmp_path, reference, ["train.micro_batch_size=2", "parallel.ep=2", "parallel.pp=2"], 4)


@pytest.mark.slow
def test_ep2_pp2_dp2_two_microbatches_per_rank(tmp_path, reference):
    """1F1B with two micro-batches of 2 per rank at dp=2, balancing losses on: the reference runs
    micro-batches of 4, which hold the samples of the ranks' micro-batches of the same index (when a rank
    took consecutive micro-batches of its slice, no one-process run matched: step 2 grad norm 0.939868 vs
    0.939749)."""
    _check(tmp_path, reference, ["train.micro_batch_size=2", "train.global_batch_size=8", "parallel.ep=2",
                                 "parallel.pp=2"], 4, reference_batch=TWO_MICROBATCHES_OF_4)


@pytest.mark.slow
def test_ep2_pp2_interleaved_full_recompute(tmp_path, reference):
    """Two micro-batches per rank (the interleaved schedule needs a multiple of pp), balancing losses on;
    recomputation re-runs the exchanges in backward."""
    _check(tmp_path, reference, ["train.micro_batch_size=2", "train.global_batch_size=8", "parallel.ep=2",
                                 "parallel.pp=2", "parallel.vpp=2", "train.recompute=full"], 4,
           reference_batch=TWO_MICROBATCHES_OF_4)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_capacity_drops_do_not_depend_on_ep(tmp_path, tp):
    """Capacity is per routing rank and expert: ep=2 drops exactly what ep=1 drops on the same dp ranks
    (dp=2 both; with tp=2 + sp the tp group's tokens), and the runs agree within the parity tolerances."""
    cap = ["model.moe_capacity_factor=1.0", "train.micro_batch_size=2", f"parallel.tp={tp}",
           f"parallel.sequence_parallel={tp > 1}"]
    ep1 = _run(tmp_path / "ep1", cap, 2 * tp)
    ep2 = _run(tmp_path / "ep2", [*cap, "parallel.ep=2"], 2 * tp)
    assert_parity(ep1, ep2)
    assert [r["tokens_dropped"] for r in ep1] == [r["tokens_dropped"] for r in ep2]
    assert sum(r["tokens_dropped"] for r in ep2) > 0


@pytest.mark.slow
def test_ep2_cp2(tmp_path, reference):
    _check(tmp_path, reference, ["train.micro_batch_size=2", "parallel.ep=2", "parallel.cp=2"], 4)


@pytest.mark.slow
def test_ep2_dp4_zero3(tmp_path, reference):
    """The strongest sharding level: experts sharded over their expert-dp group (2 ranks), dense weights over 4."""
    _check(tmp_path, reference, ["train.micro_batch_size=1", "parallel.ep=2", "optim.sharding=optim_grads_params",
                                 "optim.bucket_size=4000"], 4)


@pytest.mark.slow
def test_ep2_dp4_zero1_overlapped(tmp_path, reference):
    """The distributed optimizer with overlapped reduction and gather, expert buckets on their own group."""
    _check(tmp_path, reference, ["train.micro_batch_size=1", "parallel.ep=2", "optim.sharding=optim",
                                 "optim.overlap_grad_reduce=true", "optim.overlap_param_gather=true",
                                 "optim.bucket_size=4000"], 4)


@pytest.mark.slow
def test_ep2_shared_experts(tmp_path, reference):
    _check(tmp_path, reference, ["train.micro_batch_size=2", "parallel.ep=2"], 2,
           model=["model.moe_shared_experts=1", "model.moe_shared_expert_gate=true"])


@pytest.mark.slow
def test_ep2_sigmoid_router(tmp_path, reference):
    """DeepSeek-V3 routing with the aux-free bias: the bias update uses the step's global loads."""
    _check(tmp_path, reference, ["train.micro_batch_size=2", "parallel.ep=2"], 2,
           model=["model.moe_router=sigmoid", "model.moe_bias_update_rate=0.01"])


@pytest.mark.slow  # 21 s; a MoE checkpoint reshards in the default suite in test_moe_checkpoint
def test_resharding_ep2_tp2_to_ep4_to_one_process(tmp_path, reference):
    """Train 4 steps at ep=2 x tp=2 + sp, resume at ep=4 for 3 steps, finish on one process: the losses
    continue as the one-process run's."""
    ckpt = f"checkpoint.save={tmp_path}/ckpt"
    first = _run(tmp_path / "a", ["train.micro_batch_size=2", "parallel.ep=2", "parallel.tp=2",
                                  "parallel.sequence_parallel=true", ckpt, "train.exit_interval=4"], 4)
    second = _run(tmp_path / "b", ["train.micro_batch_size=1", "parallel.ep=4", ckpt, f"checkpoint.load={tmp_path}/ckpt",
                                   "train.exit_interval=7"], 4)
    third = _run(tmp_path / "c", [ONE_MICROBATCH, ckpt, f"checkpoint.load={tmp_path}/ckpt"], 1)
    assert [r["iter"] for r in first + second + third] == list(range(1, 11))
    assert_parity(reference("tiny_llama", *MOE, ONE_MICROBATCH), first + second + third)


@pytest.mark.slow
def test_resharding_ep2_zero3_to_one_process(tmp_path, reference):
    """Expert weights and optimizer state sharded over their expert-dp group (ZeRO-3) are saved as pieces
    of the whole tensors: one process resumes them."""
    ckpt = f"checkpoint.save={tmp_path}/ckpt"
    first = _run(tmp_path / "a", ["train.micro_batch_size=1", "parallel.ep=2", "optim.sharding=optim_grads_params",
                                  "optim.bucket_size=4000", ckpt, "train.exit_interval=5"], 4)
    second = _run(tmp_path / "b", [ONE_MICROBATCH, ckpt, f"checkpoint.load={tmp_path}/ckpt"], 1)
    assert [r["iter"] for r in first + second] == list(range(1, 11))
    assert_parity(reference("tiny_llama", *MOE, ONE_MICROBATCH), first + second)


@pytest.mark.slow
def test_gpt_style_experts_with_biases_ep2(tmp_path, reference):
    """tanh-GELU experts with biases (each local expert adds its own fc2 bias), a shared expert, tied embeddings."""
    gpt = ["model.num_experts=4", "model.moe_ffn_hidden_size=64", "model.moe_shared_experts=1",
           "model.moe_aux_loss_coeff=0.01", "model.moe_z_loss_coeff=0.001", "train.global_batch_size=4"]
    run_pretrain(tmp_path, ["+experiment=tiny_gpt", *gpt, "train.micro_batch_size=2", "parallel.ep=2"], nproc=2)
    assert_parity(reference("tiny_gpt", *gpt, ONE_MICROBATCH), read_metrics(tmp_path))
