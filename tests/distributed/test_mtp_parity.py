"""Multi-token prediction reproduces the one-process run (the parity tolerances of tests/harness.py) under
tp (+sp), pp (its depths on the last stage, with the word embedding's copy there: tied or a table of its
own), vpp, dp at every sharding level, recompute and expert parallelism; its loss, logged apart, matches
too. One layout in the default suite (tp2+sp x pp2: the sequence-sharded depths and the embedding copy
on the last stage at once); the matrix is slow."""

import pytest

from tests.harness import assert_parity

MTP = ["model.mtp_layers=2"]
LAYOUTS = {
    "tp2_sp_pp2": ("tiny_llama", 4, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.pp=2"]),
    "tp2": ("tiny_llama", 2, ["parallel.tp=2"]),
    "tp2_sp": ("tiny_llama", 2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "pp2": ("tiny_llama", 2, ["parallel.pp=2"]),  # untied: the last stage's own copy of the word embedding
    "pp2_tied": ("tiny_llama", 2, ["parallel.pp=2", "model.tie_embeddings=true"]),  # the output layer's copy
    "gpt_pp2_vpp2": ("tiny_gpt", 2, ["parallel.pp=2", "parallel.vpp=2"]),
    "dp2_zero1": ("tiny_llama", 2, ["optim.sharding=optim"]),
    "dp2_zero2": ("tiny_llama", 2, ["optim.sharding=optim_grads", "optim.overlap_grad_reduce=true"]),
    "dp2_zero3": ("tiny_llama", 2, ["optim.sharding=optim_grads_params"]),
    "pp2_dp2_zero3": ("tiny_llama", 4, ["parallel.pp=2", "optim.sharding=optim_grads_params"]),
    "tp2_recompute_full": ("tiny_llama", 2, ["parallel.tp=2", "train.recompute=full"]),
    "pp2_recompute_selective": ("tiny_llama", 2, ["parallel.pp=2", "train.recompute=selective"]),
    # the balancing losses off: they are over each micro-batch's global tokens, which differ from the reference's
    "moe_ep2": ("tiny_llama", 2, ["model=moe_tiny", "model.moe_aux_loss_coeff=0", "model.moe_z_loss_coeff=0",
                                  "parallel.ep=2"]),
}


def _check(reference, launch, layout):
    experiment, nproc, overrides = LAYOUTS[layout]
    model_keys = [o for o in overrides if o.startswith(("model=", "model."))]
    ref = reference(experiment, *model_keys, *MTP)
    run = launch(experiment, nproc, *overrides, *MTP)
    assert_parity(ref, run)
    assert "mtp_loss" in ref[0] and "mtp_loss" in run[0]
    assert abs(run[0]["mtp_loss"] - ref[0]["mtp_loss"]) <= 1e-5 * ref[0]["mtp_loss"], (run[0], ref[0])
    for r, x in zip(ref[:10], run[:10]):
        assert abs(x["mtp_loss"] - r["mtp_loss"]) <= 1e-4 * r["mtp_loss"], (x, r)


def test_mtp_matches_one_process(reference, launch):
    _check(reference, launch, "tp2_sp_pp2")


SLOW = [name for name in LAYOUTS if name != "tp2_sp_pp2"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", SLOW)
def test_mtp_matrix_matches_one_process(reference, launch, layout):
    _check(reference, launch, layout)


def test_mtp_trains_and_is_logged_apart(reference):
    """The MTP term changes the gradient, not the logged main loss: the first step's loss equals the run
    without it, its grad norm does not."""
    plain, mtp = reference("tiny_llama"), reference("tiny_llama", *MTP)
    assert abs(mtp[0]["loss"] - plain[0]["loss"]) <= 1e-6 * plain[0]["loss"]
    assert mtp[0]["grad_norm"] != plain[0]["grad_norm"]
    assert "mtp_loss" not in plain[0] and mtp[0]["mtp_loss"] > 0
