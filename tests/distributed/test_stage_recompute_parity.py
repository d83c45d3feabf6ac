"""Per-stage recompute (``train.recompute_layers``) matches the one-process reference (the parity
tolerances of tests/harness.py), fp32: recomputation re-runs the same forward, so only which layers store
their activations changes. One case runs by default; the layouts it composes with are marked slow."""

import pytest

from tests.harness import assert_parity, read_metrics, run_pretrain

CASES = {  # name: (arch, processes, overrides)
    # uneven stages, the first recomputing two of its three layers, the last none
    "pp2_uneven_full": ("llama", 2, ["parallel.pp=2", "parallel.pipeline_layout=[3,1]", "train.recompute=full",
                                     "train.recompute_layers=[2,0]"]),
    # interleaved: one entry per virtual stage
    "pp2_vpp2_uneven_full": ("gpt", 2, ["parallel.pp=2", "parallel.vpp=2", "parallel.pipeline_layout=[2,1,1,0]",
                                        "train.recompute=full", "train.recompute_layers=[1,1,0,0]"]),
    "pp2_tp2_sp_selective": ("llama", 4, ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                                          "train.recompute=selective", "train.recompute_layers=[1,2]"]),
    "pp2_dp2_zero1_full": ("gpt", 4, ["parallel.pp=2", "parallel.dp=2", "optim.sharding=optim",
                                      "train.recompute=full", "train.recompute_layers=[0,1]"]),
    "pp2_dp2_zero3_full": ("llama", 4, ["parallel.pp=2", "parallel.dp=2", "optim.sharding=optim_grads_params",
                                        "train.recompute=full", "train.recompute_layers=[2,1]"]),
    "dp2_zero2_full": ("llama", 2, ["parallel.dp=2", "optim.sharding=optim_grads", "train.recompute=full",
                                    "train.recompute_layers=[3]"]),
}
DEFAULT = {"pp2_uneven_full"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in DEFAULT else pytest.mark.slow) for n in CASES])
def test_per_stage_recompute_matches_reference(name, reference_dir, tmp_path):
    arch, nproc, overrides = CASES[name]
    reference = reference_dir(f"tiny_{arch}")
    run_pretrain(tmp_path, [f"+experiment=tiny_{arch}", *overrides], nproc=nproc)
    assert_parity(read_metrics(reference), read_metrics(tmp_path))
