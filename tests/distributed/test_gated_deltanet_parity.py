"""Gated DeltaNet layers (three per full-attention layer, Qwen3-Next's pattern, the full attention with its
output gate, partial rotary and (1 + w) RMSNorms) reproduce the one-process run at every layout (the parity
tolerances of tests/harness.py): heads split over tp (+sp), the recurrent state passed between cp ranks
(cp=2 and cp=4, over the load-balanced chunks; with documents the state restarts at each one), the layer kind
differing per pipeline stage under every schedule, ZeRO-3, recompute and compile. The default suite runs the
step-1 gradient of every parameter at tp2 + sp x cp2 (per tensor) and cp=4 with documents; the rest is slow."""

import pytest

from megand.core.checkpointing.offline import load_full_tensors
from tests.harness import assert_parity, read_metrics, run_pretrain

HYBRID = ["model.layer_types=[linear_attention,linear_attention,linear_attention,attention]",
          "model.linear_num_key_heads=2", "model.linear_num_value_heads=4", "model.linear_key_head_dim=16",
          "model.linear_value_head_dim=8", "model.attention_output_gate=true", "model.partial_rotary_factor=0.5",
          "model.norm_unit_offset=true", "model.qk_norm=true"]
LAYOUTS = {
    "cp2": (2, ["parallel.cp=2"]),
    "cp4": (4, ["parallel.cp=4"]),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "tp2_sp_selective": (2, ["parallel.tp=2", "parallel.sequence_parallel=true", "train.recompute=selective"]),
    "pp2": (2, ["parallel.pp=2"]),
    "pp2_vpp2_full": (2, ["parallel.pp=2", "parallel.vpp=2", "train.recompute=full"]),
    "pp2_zb1p": (2, ["parallel.pp=2", "parallel.pp_schedule=zb1p"]),
    "pp2_zbv": (2, ["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=zbv"]),
    "pp2_dualpipev": (2, ["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=dualpipev"]),
    "dp2_zero3": (2, ["optim.sharding=optim_grads_params"]),
    "dp2_zero1_cp2": (4, ["parallel.cp=2", "optim.sharding=optim"]),
    "tp2_cp2_selective": (4, ["parallel.tp=2", "parallel.cp=2", "train.recompute=selective"]),
    "compile": (1, ["train.compile=true"]),
}
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hybrid_layout_matches_one_process(reference, launch, layout):
    nproc, overrides = LAYOUTS[layout]
    assert_parity(reference("tiny_llama", *HYBRID), launch("tiny_llama", nproc, *HYBRID, *overrides))


from tests.distributed.test_model_features_parity import short_docs  # noqa: E402,F401  (the fixture)


@pytest.mark.slow  # the default run keeps the hybrid model at cp2 (per tensor, below)
@pytest.mark.parametrize("layout", ["cp4"])
def test_documents_restart_the_state_across_cp_ranks(reference, launch, short_docs, layout):
    """Several documents per sample: the state and the convolution restart at each one, on every cp rank."""
    nproc, overrides = LAYOUTS[layout]
    assert_parity(reference("tiny_llama", *HYBRID, *short_docs),
                  launch("tiny_llama", nproc, *HYBRID, *short_docs, *overrides))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["cp2", "tp2_sp", "pp2"])
def test_documents_matrix(reference, launch, short_docs, layout):
    nproc, overrides = LAYOUTS[layout]
    assert_parity(reference("tiny_llama", *HYBRID, *short_docs),
                  launch("tiny_llama", nproc, *HYBRID, *short_docs, *overrides))


def _moments_after_one_step(run_dir, nproc, overrides):
    save = str(run_dir / "ckpt")
    run_pretrain(run_dir, ["+experiment=tiny_llama", *HYBRID, "train.iters=1", "train.eval_iters=0",
                           f"checkpoint.save={save}", *overrides], nproc=nproc)
    return load_full_tensors(save, prefix="optim.")


def test_step_one_gradient_per_tensor_tp2_sp_cp2(tmp_path):
    """AdamW's first moment after step 1, ``(1 - beta1) g``, of every parameter (the linear attention's
    projections, convolution, A_log, dt_bias and gated norm included) at tp2 + sp x cp2: within 5e-6."""
    ref = _moments_after_one_step(tmp_path / "one", 1, ())
    run = _moments_after_one_step(tmp_path / "tp2_cp2", 4, ("parallel.tp=2", "parallel.sequence_parallel=true",
                                                            "parallel.cp=2"))
    moments = sorted(k for k in ref if k.endswith(".exp_avg"))
    assert any(".attention.conv." in k for k in moments) and any(".attention.a_log." in k for k in moments)
    assert sorted(k for k in run if k.endswith(".exp_avg")) == moments
    for key in moments:
        diff = (run[key] - ref[key]).norm() / ref[key].norm().clamp_min(1e-30)
        assert diff <= 5e-6, f"{key}: relative difference {diff:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2_sp", "cp2"])
def test_bf16_follows_the_one_process_bf16_run(reference_dir, tmp_path, layout):
    """bf16 (the delta rule's core runs in fp32): the reduction order differs from one process, so the losses
    agree within 2e-2 relative over 3 steps (the bf16 bound of the other layout tests), not bit for bit."""
    bf16 = ["train.precision=bf16", "train.iters=3", "train.eval_iters=0"]
    ref = read_metrics(reference_dir("tiny_llama", *HYBRID, *bf16))
    nproc, overrides = LAYOUTS[layout]
    run_pretrain(tmp_path, ["+experiment=tiny_llama", *HYBRID, *bf16, *overrides], nproc=nproc)
    run = read_metrics(tmp_path)
    assert len(run) == len(ref) == 3
    for r, x in zip(ref, run):
        assert abs(x["loss"] - r["loss"]) <= 2e-2 * r["loss"], (x["loss"], r["loss"])
