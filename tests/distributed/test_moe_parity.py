"""Mixture-of-Experts layouts reproduce the one-process run (the parity tolerances of tests/harness.py).

``moe_tiny``: 4 experts, top-2, every layer MoE, aux-loss and z-loss coefficients nonzero, dropless.
The balancing losses are computed over each micro-batch's global tokens, so the one-process reference
must see the same micro-batches. ``rank_microbatches`` gives each dp rank a contiguous slice of the
global batch, and micro-batch i of the step is the union of every dp rank's i-th: with one micro-batch
per dp rank (global batch 8 = dp x micro-batch) that union is the whole batch, i.e. the reference's one
micro-batch of 8. Layouts without dp (tp, cp, pp) keep the reference's micro-batches of 2 as they are.
"""

import pytest

from tests.harness import assert_parity, read_metrics, run_pretrain

MOE = ("tiny_llama", "model=moe_tiny")
ONE_MICROBATCH = "train.micro_batch_size=8"  # the reference of the dp layouts (see above)
SIGMOID_SHARED = ("model.moe_router=sigmoid", "model.moe_shared_experts=1", "model.moe_shared_expert_gate=true",
                  "model.moe_bias_update_rate=0.01")
TP2_SP = ("parallel.tp=2", "parallel.sequence_parallel=true")

CASES = {  # name: (processes, reference overrides, run overrides)
    # experts split over tp (etp = tp): the tokens gathered over tp / partial outputs reduce-scattered
    "tp2_sp": (2, (), TP2_SP),
    # etp = tp without sp: routing replicated over tp, the routing weights' partial gradients summed
    "tp2": (2, (), ("parallel.tp=2",)),
    # etp = 1: whole experts on each tp rank, each routing its own share of the tokens
    "tp2_sp_etp1": (2, (), (*TP2_SP, "parallel.etp=1")),
    "tp2_etp1": (2, (), ("parallel.tp=2", "parallel.etp=1")),
    # dp with the strongest sharding level: one micro-batch per dp rank
    "dp2_zero3": (2, (ONE_MICROBATCH,), ("train.micro_batch_size=4", "optim.sharding=optim_grads_params",
                                         "optim.bucket_size=4000", "optim.overlap_grad_reduce=true")),
    "dp4_zero3_sigmoid_shared": (4, (ONE_MICROBATCH, *SIGMOID_SHARED),
                                 ("train.micro_batch_size=2", "optim.sharding=optim_grads_params",
                                  "optim.bucket_size=4000", *SIGMOID_SHARED)),
    "pp2_sigmoid_shared": (2, SIGMOID_SHARED, ("parallel.pp=2", *SIGMOID_SHARED)),
    "pp2_vpp2": (2, (), ("parallel.pp=2", "parallel.vpp=2")),
    "cp2": (2, (), ("parallel.cp=2",)),
    "cp2_tp2_sp_etp1_shared": (4, ("model.moe_shared_experts=2",),
                               ("parallel.cp=2", *TP2_SP, "parallel.etp=1", "model.moe_shared_experts=2")),
    "tp2_sp_recompute_full": (2, (), (*TP2_SP, "train.recompute=full")),
    "pp2_recompute_full_sigmoid": (2, SIGMOID_SHARED, ("parallel.pp=2", "train.recompute=full", *SIGMOID_SHARED)),
    "tp2_dp2_sp_zero1_every_other_layer": (4, (ONE_MICROBATCH, "model.moe_layer_freq=2"),
                                           (*TP2_SP, "train.micro_batch_size=4", "optim.sharding=optim",
                                            "model.moe_layer_freq=2")),
}
# (MoE with tp runs in the default suite at ep2 x tp2+sp in test_expert_parallel_parity)
DEFAULT = {"dp4_zero3_sigmoid_shared", "pp2_sigmoid_shared"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in DEFAULT else pytest.mark.slow) for n in CASES])
def test_moe_layout_matches_one_process(reference, tmp_path, name):
    nproc, ref_overrides, overrides = CASES[name]
    experiment, model = MOE
    run_pretrain(tmp_path, [f"+experiment={experiment}", model, *overrides], nproc=nproc)
    run, ref = read_metrics(tmp_path), reference(experiment, model, *ref_overrides)
    assert_parity(ref, run)
    for key in ("aux_loss", "z_loss", "expert_load_max_over_mean"):  # the routing statistics agree too
        for r, x in zip(ref, run):
            assert abs(r[key] - x[key]) <= 1e-4 * abs(r[key]), (key, r["iter"], x[key], r[key])


@pytest.mark.slow
def test_capacity_drops_match_one_process_when_experts_split_over_tp(reference, tmp_path):
    """With a capacity factor, experts split over tp (etp = tp, sequence parallel) see the tp group's whole
    micro-batch, as the one process does: the same assignments are dropped (each counted once, not once
    per tp rank) and the run still matches."""
    experiment, model = MOE
    capacity = "model.moe_capacity_factor=1.0"
    run_pretrain(tmp_path, [f"+experiment={experiment}", model, *TP2_SP, capacity], nproc=2)
    run, ref = read_metrics(tmp_path), reference(experiment, model, capacity)
    assert_parity(ref, run)
    assert [r["tokens_dropped"] for r in run] == [r["tokens_dropped"] for r in ref]
    assert all(r["tokens_dropped"] > 0 for r in ref)


@pytest.mark.slow
def test_capacity_drops_are_deterministic_with_etp1(tmp_path):
    """etp = 1 drops per tp rank's own share (layout-dependent by nature): two runs are bit-identical."""
    experiment, model = MOE
    runs = []
    for name in ("a", "b"):
        run_pretrain(tmp_path / name, [f"+experiment={experiment}", model, "parallel.tp=2", "parallel.etp=1",
                                       "train.micro_batch_size=4", "model.moe_capacity_factor=1.0"], nproc=4)
        runs.append(read_metrics(tmp_path / name))
    for key in ("loss", "grad_norm", "tokens_dropped"):
        assert [r[key] for r in runs[0]] == [r[key] for r in runs[1]], key
    assert runs[0][0]["tokens_dropped"] > 0


@pytest.mark.slow
def test_moe_bf16_short_run_follows_fp32(reference, tmp_path):
    """bf16 (tp=2 + sp, sigmoid router and shared experts): 3 steps, losses near the fp32 run's."""
    experiment, model = MOE
    run_pretrain(tmp_path, [f"+experiment={experiment}", model, *TP2_SP, *SIGMOID_SHARED, "train.precision=bf16",
                            "train.iters=3"], nproc=2)
    run, ref = read_metrics(tmp_path), reference(experiment, model, *SIGMOID_SHARED)
    assert len(run) == 3
    for r, x in zip(ref, run):
        assert abs(x["loss"] - r["loss"]) <= 2e-2 * r["loss"], (x["loss"], r["loss"])


# GPT style: tanh-GELU experts with biases (fc1's split over tp with its rows, fc2's added once after the
# tp reduction; under ZeRO-3 the MoE block borrows it), tied embeddings
GPT_MOE = ("model.num_experts=4", "model.moe_ffn_hidden_size=64", "model.moe_shared_experts=1",
           "model.moe_aux_loss_coeff=0.01", "model.moe_z_loss_coeff=0.001")
GPT_CASES = {
    "tp2_sp": (2, (), TP2_SP),
    "tp2_etp1": (2, (), ("parallel.tp=2", "parallel.etp=1")),
    "tp2_sp_dp2_zero3": (4, (ONE_MICROBATCH,), (*TP2_SP, "train.micro_batch_size=4",
                                                "optim.sharding=optim_grads_params", "optim.bucket_size=4000")),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", GPT_CASES)
def test_gpt_moe_layout_matches_one_process(reference, tmp_path, name):
    nproc, ref_overrides, overrides = GPT_CASES[name]
    run_pretrain(tmp_path, ["+experiment=tiny_gpt", *GPT_MOE, *overrides], nproc=nproc)
    assert_parity(reference("tiny_gpt", *GPT_MOE, *ref_overrides), read_metrics(tmp_path))
